package dpar

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"dpar.dev/go/raw"
)

// ReducerOptions are a reducer's bucket sizes and the processes it reduces over; a zero value takes dpar's default.
type ReducerOptions struct {
	FirstBucketBytes int // the first bucket (the last gradients) closes at this many bytes (default 1 MiB)
	BucketCapBytes   int // later buckets close at this many bytes (default 25 MiB)
	// Processes is a communicator over the processes (NewMPIComm), or nil. With one, the reducers of a group's
	// members in several processes sum over every member of every process, hierarchically: among the process's
	// members, then across the processes by member 0, then back. Every member passes its process's same Comm, which
	// runs no other collective during a step; dpar keeps it for the reducer, so it may be closed first. With Mean,
	// every process creates its reducers at the same point: member 0's creation counts every process's members.
	Processes *Comm
	// Compression is how buckets cross the processes: CompressionNone (default) or CompressionBF16.
	Compression Compression
}

// Reducer is DDP's gradient reducer over a communicator, for a program with its own autograd: it registers the
// gradient buffers once; each step, GradReady marks a gradient as holding its value as soon as backward has
// produced it, which starts the all-reduce of every bucket this completes while backward goes on, and Wait, before
// the optimizer step, leaves the sum or mean over the participants in every buffer. A gradient not marked in a step
// counts as zero. Every participant registers the same sizes in the same order, and does not use the
// communicator for other collectives between a step's first GradReady and its Wait.
//
// dpar reads and writes the buffers between calls, which cgo forbids for Go memory: NewReducer's gradients are C
// memory that the reducer owns, reached through Grad; NewReducerUnsafe's are the caller's (a GPU's).
//
// Its methods may be called from several goroutines (a backward pass that produces gradients concurrently).
type Reducer struct {
	mu     sync.Mutex
	raw    raw.Struct_SS_dpar_reducer
	memory unsafe.Pointer // NewReducer's gradients, one block: freed after the reducer
	grads  [][]float32    // NewReducer's gradients, views of memory
	lent   bool           // Grad has handed out a view of memory
	ready  []bool         // marked in this step: dpar's until Wait
}

// NewReducer makes a reducer over c for gradients of counts elements each, in the model's forward order (backward
// produces the last first, and the buckets follow it), in memory the reducer allocates: write gradient i through
// Grad(i). op is Sum, or Mean (DDP's average).
func NewReducer(c *Comm, counts []int, op ReduceOp, o ReducerOptions) (*Reducer, error) {
	total := 0
	for i, n := range counts {
		if err := sizeArg(fmt.Sprintf("counts[%d]", i), n); err != nil {
			return nil, err
		}
		total += n
	}
	// One block in registration order: the gradients of a bucket are then adjacent, and dpar reduces them in
	// place instead of through a copy. Never empty, so that dpar, not a NULL, explains counts it refuses.
	memory, all, err := cBuffer[float32](total + 1)
	if err != nil {
		return nil, err
	}
	grads := make([][]float32, len(counts))
	addresses := make([]unsafe.Pointer, len(counts))
	at := 0
	for i, n := range counts {
		grads[i] = all[at : at+n : at+n]
		addresses[i] = unsafe.Pointer(&all[at])
		at += n
	}
	r, err := newReducer(c, addresses, counts, op, o)
	if err != nil {
		freeC(memory)
		return nil, err
	}
	r.memory, r.grads = memory, grads
	return r, nil
}

// NewReducerUnsafe makes a reducer over c for gradients at the given addresses, counts[i] float32 elements at
// grads[i], in the memory of c.Device(): a GPU's in a group made by NewCommGroupOnDevices on CUDA devices, where
// the reducer's copies and collectives are ordered on the participant's stream (mark a gradient ready once the
// work that computes it is queued there), or host memory allocated by C. dpar uses them until the reducer is
// closed: they must not be Go memory, must not overlap, and must stay valid until Close returns.
func NewReducerUnsafe(c *Comm, grads []unsafe.Pointer, counts []int, op ReduceOp, o ReducerOptions) (*Reducer, error) {
	if err := sameLen("counts", len(counts), len(grads)); err != nil {
		return nil, err
	}
	for i, n := range counts {
		if err := sizeArg(fmt.Sprintf("counts[%d]", i), n); err != nil {
			return nil, err
		}
	}
	return newReducer(c, grads, counts, op, o)
}

func newReducer(c *Comm, grads []unsafe.Pointer, counts []int, op ReduceOp, o ReducerOptions) (*Reducer, error) {
	if err := firstError(sizeArg("FirstBucketBytes", o.FirstBucketBytes),
		sizeArg("BucketCapBytes", o.BucketCapBytes)); err != nil {
		return nil, err
	}
	// A closed Comm's handle is nil, which dpar would take for no processes at all.
	if o.Processes != nil && o.Processes.handle() == nil {
		return nil, invalid("Processes: the communicator is closed")
	}
	// Addresses as integers, and one element more than needed, so that dpar (not a NULL array) speaks of an empty
	// list; the addresses are outside Go memory, so the Go array that holds them is for cgo a plain buffer.
	addresses := make([]uintptr, len(grads)+1)
	sizes := make([]uint64, len(counts)+1)
	for i := range grads {
		addresses[i] = uintptr(grads[i])
		sizes[i] = uint64(counts[i])
	}
	opts := raw.NewDpar_reducer_options()
	defer raw.DeleteDpar_reducer_options(opts)
	var p uintptr
	err := call(func() int {
		if s := raw.Dpar_reducer_options_init(opts); s != int(OK) {
			return s
		}
		opts.SetFirst_bucket_bytes(int64(o.FirstBucketBytes))
		opts.SetBucket_cap_bytes(int64(o.BucketCapBytes))
		opts.SetOp(int(op))
		opts.SetProcesses(o.Processes.handle())
		opts.SetCompression(int(o.Compression))
		return raw.Dpar_reducer_create(unsafe.Pointer(&p), c.handle(), unsafe.Pointer(&addresses[0]),
			unsafe.Pointer(&sizes[0]), int64(len(grads)), opts)
	})
	// The handles live through the call; dpar keeps the communicators behind them for the reducer.
	runtime.KeepAlive(c)
	runtime.KeepAlive(o.Processes)
	if err != nil {
		return nil, err
	}
	r := &Reducer{raw: raw.SwigcptrStruct_SS_dpar_reducer(p), ready: make([]bool, len(grads))}
	runtime.SetFinalizer(r, (*Reducer).finalize)
	return r, nil
}

// finalize is Close for a reducer that became unreachable without one, except that the gradients' memory stays
// allocated once Grad has lent a view of it: the collector cannot see that view, which may still be in use, so
// only an explicit Close may free it (as syscall.Munmap ends an mmap'd slice).
func (r *Reducer) finalize() {
	r.mu.Lock()
	defer r.mu.Unlock()
	release(r, &r.raw, raw.Dpar_reducer_free)
	if !r.lent {
		freeC(r.memory)
	}
	r.memory, r.grads, r.ready = nil, nil, nil
}

// handle is the reducer's dpar handle, nil for a nil or closed Reducer: dpar then refuses the call with its own
// message.
func (r *Reducer) handle() raw.Struct_SS_dpar_reducer {
	if r == nil {
		return nil
	}
	return r.raw
}

// lock holds r's lock, if there is an r; the returned function releases it.
func (r *Reducer) lock() func() {
	if r == nil {
		return func() {}
	}
	r.mu.Lock()
	return r.mu.Unlock
}

// NumBuckets is the number of buckets the gradients were grouped in.
func (r *Reducer) NumBuckets() (int, error) {
	defer r.lock()()
	var n uint64
	err := call(func() int { return raw.Dpar_reducer_num_buckets(unsafe.Pointer(&n), r.handle()) })
	runtime.KeepAlive(r)
	return int(n), err
}

// Grad is gradient index's memory, to write this step's value before GradReady(index) and to read the reduced one
// after Wait. It is refused for a gradient marked ready, until Wait: dpar may be reading or writing it. The slice
// is valid until Close; a reducer that the collector finalizes without a Close leaves the memory of the slices it
// lent allocated, so that they stay valid (call Close to free it).
func (r *Reducer) Grad(index int) ([]float32, error) {
	defer r.lock()()
	switch {
	case r == nil || r.raw == nil:
		return nil, invalid("Grad: the reducer is closed")
	case r.grads == nil:
		return nil, invalid("Grad: the gradients are the caller's memory (NewReducerUnsafe)")
	case index < 0 || index >= len(r.grads):
		return nil, invalid("index: %d is out of range (%d gradients registered)", index, len(r.grads))
	case r.ready[index]:
		return nil, &Error{Status: ErrInvalidState,
			Message: fmt.Sprintf("Grad: gradient %d is marked ready: it is dpar's until Wait", index)}
	}
	r.lent = true
	return r.grads[index], nil
}

// GradReady marks gradient index as holding this step's value (the first mark of a step starts it), and starts
// the all-reduce of the buckets this completes. The gradient must not be written again before Wait. Marking a
// gradient twice in a step is ErrInvalidState; neither that nor an index out of range changes the step.
func (r *Reducer) GradReady(index int) error {
	if err := sizeArg("index", index); err != nil {
		return err
	}
	defer r.lock()()
	err := call(func() int { return raw.Dpar_reducer_grad_ready(r.handle(), int64(index)) })
	runtime.KeepAlive(r)
	if err == nil {
		r.ready[index] = true
	}
	return err
}

// Wait ends the step: it reduces what is left and waits for every bucket, after which every buffer holds the sum
// or mean over the participants (a gradient a participant did not mark counts as zero there). On a collective's
// error (ErrTimeout, ErrMismatch, ErrRemote...) the buffers' content is unspecified. Either way the next GradReady
// starts a new step.
func (r *Reducer) Wait() error {
	defer r.lock()()
	err := call(func() int { return raw.Dpar_reducer_wait(r.handle()) })
	runtime.KeepAlive(r)
	if r != nil {
		for i := range r.ready {
			r.ready[i] = false
		}
	}
	return err
}

// Close frees the reducer, after its buckets in flight finish, then NewReducer's gradients (their slices are
// invalid from here). The communicators (its own and the processes') are not closed: dpar keeps them for the
// reducer, so either may be closed first. Close may be called again.
func (r *Reducer) Close() {
	if r == nil {
		return
	}
	defer r.lock()()
	release(r, &r.raw, raw.Dpar_reducer_free)
	freeC(r.memory)
	r.memory, r.grads, r.ready = nil, nil, nil
}
