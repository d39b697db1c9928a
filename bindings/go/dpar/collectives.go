package dpar

// #include <stdlib.h>
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"

	"dpar.dev/go/raw"
)

// Element is a type the collectives move: dpar's F32, F64, I32 and I64.
type Element interface {
	float32 | float64 | int32 | int64
}

// dtypeOf is T's dpar element type.
func dtypeOf[T Element]() DType {
	var zero T
	switch any(zero).(type) {
	case float32:
		return F32
	case float64:
		return F64
	case int32:
		return I32
	default:
		return I64
	}
}

// address is a slice's first element, or nil for an empty slice (dpar takes NULL for zero elements).
func address[T any](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(&s[0])
}

// invalid is an argument error found before dpar is called.
func invalid(format string, args ...any) error {
	return &Error{Status: ErrInvalidArg, Message: fmt.Sprintf(format, args...)}
}

// sameLen checks that buffer what holds the elements the collective reads or writes there.
func sameLen(what string, got, expected int) error {
	if got != expected {
		return invalid("%s: %d elements, expected %d", what, got, expected)
	}
	return nil
}

// sizeArg refuses a negative count, root or index: dpar takes a size_t, which would see a huge number instead.
func sizeArg(what string, v int) error {
	if v < 0 {
		return invalid("%s: %d is negative", what, v)
	}
	return nil
}

// handle is the communicator's dpar handle, nil for a nil or closed Comm: dpar then refuses the call with its
// own message.
func (c *Comm) handle() raw.Struct_SS_dpar_comm {
	if c == nil {
		return nil
	}
	return c.raw
}

// size is the number of participants, for the buffers that hold one block per participant.
func (c *Comm) size() (int, error) {
	var n uint64
	err := call(func() int { return raw.Dpar_comm_info(nil, unsafe.Pointer(&n), c.handle()) })
	runtime.KeepAlive(c)
	return int(n), err
}

// The collectives over Go slices. Each is a function rather than a method because Go methods cannot have type
// parameters. dpar reads and writes the slices during the call only, which cgo allows; every participant calls
// the same collective with the same lengths, op and root (dpar reports ErrMismatch otherwise).

// AllReduce reduces every participant's send into every participant's recv, of the same length (recv may be send:
// in place).
func AllReduce[T Element](c *Comm, send, recv []T, op ReduceOp) error {
	if err := sameLen("recv", len(recv), len(send)); err != nil {
		return err
	}
	return c.AllReduceUnsafe(address(send), address(recv), len(send), dtypeOf[T](), op)
}

// Broadcast copies root's buf into every participant's.
func Broadcast[T Element](c *Comm, buf []T, root int) error {
	return c.BroadcastUnsafe(address(buf), len(buf), dtypeOf[T](), root)
}

// Reduce reduces every participant's send into root's recv, of the same length. Elsewhere recv is not used and
// may be nil.
func Reduce[T Element](c *Comm, send, recv []T, op ReduceOp, root int) error {
	if len(recv) != 0 {
		if err := sameLen("recv", len(recv), len(send)); err != nil {
			return err
		}
	}
	return c.ReduceUnsafe(address(send), address(recv), len(send), dtypeOf[T](), op, root)
}

// AllGather puts every participant's send into every participant's recv, one block of len(send) per participant
// in rank order.
func AllGather[T Element](c *Comm, send, recv []T) error {
	n, err := c.size()
	if err != nil {
		return err
	}
	if err := sameLen("recv", len(recv), n*len(send)); err != nil {
		return err
	}
	return c.AllGatherUnsafe(address(send), address(recv), len(send), dtypeOf[T]())
}

// ReduceScatter reduces send, one block of len(recv) per participant, element-wise across the participants;
// participant r receives block r in recv.
func ReduceScatter[T Element](c *Comm, send, recv []T, op ReduceOp) error {
	n, err := c.size()
	if err != nil {
		return err
	}
	if err := sameLen("send", len(send), n*len(recv)); err != nil {
		return err
	}
	return c.ReduceScatterUnsafe(address(send), address(recv), len(recv), dtypeOf[T](), op)
}

// The asynchronous collectives over Go slices run on a copy in C memory (see Work): the slices stay the caller's.

// AllReduceAsync starts AllReduce(c, buf, buf, op) on the communicator's own thread; Wait puts the result in buf.
func AllReduceAsync[T Element](c *Comm, buf []T, op ReduceOp) (*Work, error) {
	return startStaged(buf, buf, true, func(send, recv unsafe.Pointer) (*Work, error) {
		return c.AllReduceAsyncUnsafe(send, recv, len(buf), dtypeOf[T](), op)
	})
}

// BroadcastAsync starts Broadcast(c, buf, root); Wait puts root's values in buf.
func BroadcastAsync[T Element](c *Comm, buf []T, root int) (*Work, error) {
	return startStaged(buf, buf, true, func(p, _ unsafe.Pointer) (*Work, error) {
		return c.BroadcastAsyncUnsafe(p, len(buf), dtypeOf[T](), root)
	})
}

// AllGatherAsync starts AllGather(c, send, recv); Wait fills recv.
func AllGatherAsync[T Element](c *Comm, send, recv []T) (*Work, error) {
	n, err := c.size()
	if err != nil {
		return nil, err
	}
	if err := sameLen("recv", len(recv), n*len(send)); err != nil {
		return nil, err
	}
	return startStaged(send, recv, false, func(s, r unsafe.Pointer) (*Work, error) {
		return c.AllGatherAsyncUnsafe(s, r, len(send), dtypeOf[T]())
	})
}

// ReduceScatterAsync starts ReduceScatter(c, send, recv, op); Wait fills recv.
func ReduceScatterAsync[T Element](c *Comm, send, recv []T, op ReduceOp) (*Work, error) {
	n, err := c.size()
	if err != nil {
		return nil, err
	}
	if err := sameLen("send", len(send), n*len(recv)); err != nil {
		return nil, err
	}
	return startStaged(send, recv, false, func(s, r unsafe.Pointer) (*Work, error) {
		return c.ReduceScatterAsyncUnsafe(s, r, len(recv), dtypeOf[T](), op)
	})
}

// cBuffer is n zeroed elements of T in C memory (nil for none), to be released with freeC. calloc, not C.malloc:
// cgo's C.malloc ends the program when memory runs out, calloc returns NULL and checks n x size for overflow.
func cBuffer[T Element](n int) (unsafe.Pointer, []T, error) {
	if n == 0 {
		return nil, nil, nil
	}
	var zero T
	p := C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(zero)))
	if p == nil {
		return nil, nil, &Error{Status: ErrOutOfMemory,
			Message: fmt.Sprintf("no memory for %d elements of %d bytes", n, unsafe.Sizeof(zero))}
	}
	return p, unsafe.Slice((*T)(p), n), nil
}

// freeC releases cBuffer's memory (nil is fine).
func freeC(p unsafe.Pointer) { C.free(p) }

// startStaged copies send into C memory, with room for recv after it (or none when the collective works in
// place), starts the collective on those addresses, and gives the Work the memory and the copy back into recv.
func startStaged[T Element](send, recv []T, inPlace bool,
	start func(send, recv unsafe.Pointer) (*Work, error)) (*Work, error) {
	room := len(send) + len(recv)
	if inPlace {
		room = len(send)
	}
	memory, staged, err := cBuffer[T](room)
	if err != nil {
		return nil, err
	}
	copy(staged, send)
	result := staged
	if !inPlace {
		result = staged[len(send):]
	}
	w, err := start(address(staged[:len(send)]), address(result))
	if err != nil {
		freeC(memory)
		return nil, err
	}
	w.staging = memory
	w.deliver = func() { copy(recv, result) }
	return w, nil
}

// AllReduceUnsafe is AllReduce on count elements at send and recv (recv may equal send: in place).
//
// The *Unsafe collectives take addresses, for memory that is not a Go slice: a GPU's in a group made by
// NewCommGroupOnDevices on CUDA devices (ordered on the participant's stream, as dpar.h describes), or host memory
// allocated by C. count is in elements of dtype (F32, F64, I32 or I64). A synchronous call uses the addresses only
// while it runs. An asynchronous one keeps them until its Work is done: they must not be Go memory (cgo forbids C
// keeping a Go pointer), and must stay valid and untouched until Wait or Close returns.
func (c *Comm) AllReduceUnsafe(send, recv unsafe.Pointer, count int, dtype DType, op ReduceOp) error {
	if err := sizeArg("count", count); err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return call(func() int { return raw.Dpar_comm_all_reduce(c.handle(), send, recv, int64(count), int(dtype), int(op)) })
}

// BroadcastUnsafe is Broadcast on count elements at buf.
func (c *Comm) BroadcastUnsafe(buf unsafe.Pointer, count int, dtype DType, root int) error {
	if err := firstError(sizeArg("count", count), sizeArg("root", root)); err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return call(func() int { return raw.Dpar_comm_broadcast(c.handle(), buf, int64(count), int(dtype), int64(root)) })
}

// ReduceUnsafe is Reduce on count elements at send, into root's recv (nil elsewhere is fine).
func (c *Comm) ReduceUnsafe(send, recv unsafe.Pointer, count int, dtype DType, op ReduceOp, root int) error {
	if err := firstError(sizeArg("count", count), sizeArg("root", root)); err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return call(func() int {
		return raw.Dpar_comm_reduce(c.handle(), send, recv, int64(count), int(dtype), int(op), int64(root))
	})
}

// AllGatherUnsafe is AllGather of count elements at send into size x count elements at recv.
func (c *Comm) AllGatherUnsafe(send, recv unsafe.Pointer, count int, dtype DType) error {
	if err := sizeArg("count", count); err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return call(func() int { return raw.Dpar_comm_all_gather(c.handle(), send, recv, int64(count), int(dtype)) })
}

// ReduceScatterUnsafe is ReduceScatter of size x count elements at send into count elements at recv.
func (c *Comm) ReduceScatterUnsafe(send, recv unsafe.Pointer, count int, dtype DType, op ReduceOp) error {
	if err := sizeArg("count", count); err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return call(func() int {
		return raw.Dpar_comm_reduce_scatter(c.handle(), send, recv, int64(count), int(dtype), int(op))
	})
}

// AllReduceAsyncUnsafe starts AllReduceUnsafe on the communicator's own thread; dpar keeps the addresses, which
// must not be Go memory, until the Work is done (see AllReduceUnsafe).
func (c *Comm) AllReduceAsyncUnsafe(send, recv unsafe.Pointer, count int, dtype DType, op ReduceOp) (*Work, error) {
	if err := sizeArg("count", count); err != nil {
		return nil, err
	}
	return c.startWork(func(out unsafe.Pointer) int {
		return raw.Dpar_comm_all_reduce_async(out, c.handle(), send, recv, int64(count), int(dtype), int(op))
	})
}

// BroadcastAsyncUnsafe starts BroadcastUnsafe on the communicator's own thread; dpar keeps the addresses, which
// must not be Go memory, until the Work is done (see AllReduceUnsafe).
func (c *Comm) BroadcastAsyncUnsafe(buf unsafe.Pointer, count int, dtype DType, root int) (*Work, error) {
	if err := firstError(sizeArg("count", count), sizeArg("root", root)); err != nil {
		return nil, err
	}
	return c.startWork(func(out unsafe.Pointer) int {
		return raw.Dpar_comm_broadcast_async(out, c.handle(), buf, int64(count), int(dtype), int64(root))
	})
}

// AllGatherAsyncUnsafe starts AllGatherUnsafe on the communicator's own thread; dpar keeps the addresses, which
// must not be Go memory, until the Work is done (see AllReduceUnsafe).
func (c *Comm) AllGatherAsyncUnsafe(send, recv unsafe.Pointer, count int, dtype DType) (*Work, error) {
	if err := sizeArg("count", count); err != nil {
		return nil, err
	}
	return c.startWork(func(out unsafe.Pointer) int {
		return raw.Dpar_comm_all_gather_async(out, c.handle(), send, recv, int64(count), int(dtype))
	})
}

// ReduceScatterAsyncUnsafe starts ReduceScatterUnsafe on the communicator's own thread; dpar keeps the addresses,
// which must not be Go memory, until the Work is done (see AllReduceUnsafe).
func (c *Comm) ReduceScatterAsyncUnsafe(send, recv unsafe.Pointer, count int, dtype DType, op ReduceOp) (*Work, error) {
	if err := sizeArg("count", count); err != nil {
		return nil, err
	}
	return c.startWork(func(out unsafe.Pointer) int {
		return raw.Dpar_comm_reduce_scatter_async(out, c.handle(), send, recv, int64(count), int(dtype), int(op))
	})
}

func firstError(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// startWork runs a dpar_comm_*_async call, which writes the work's handle through out.
func (c *Comm) startWork(start func(out unsafe.Pointer) int) (*Work, error) {
	var p uintptr
	err := call(func() int { return start(unsafe.Pointer(&p)) })
	runtime.KeepAlive(c)
	if err != nil {
		return nil, err
	}
	w := &Work{raw: raw.SwigcptrStruct_SS_dpar_work(p), comm: c}
	runtime.SetFinalizer(w, (*Work).Close)
	return w, nil
}

// Work is an asynchronous collective in flight. Operations started on one Comm run in the order they were
// started; their Works may be waited for in any order. Like its Comm, a Work is for one goroutine at a time.
//
// dpar keeps an asynchronous collective's addresses after the call that starts it, until the work is done, and
// cgo forbids C keeping a Go pointer after a call returns (runtime.Pinner, which allows it, came with Go 1.21; this
// module is for Go 1.19). So a collective over Go slices runs on a copy in C memory that the Work owns: the
// collective reads the copy made when it starts, Wait copies the result into the slice, and until Wait the slice
// is the caller's to read and write. The *Unsafe collectives run on the caller's addresses, without a copy.
type Work struct {
	raw     raw.Struct_SS_dpar_work
	staging unsafe.Pointer // the C copy of a Go slice's collective (nil at addresses): freed once the work is done
	deliver func()         // copies the result from staging into the caller's slice
	comm    *Comm          // kept reachable, so that its finalizer does not wait on this work in dpar_comm_free
	waited  bool
	result  error // Wait's, returned again by a later Wait
}

// Test reports whether the work has finished, successfully or not, without blocking.
func (w *Work) Test() (bool, error) {
	if w != nil && w.waited {
		return true, nil
	}
	var done int32
	err := call(func() int { return raw.Dpar_work_test(unsafe.Pointer(&done), w.handle()) })
	runtime.KeepAlive(w)
	return done != 0, err
}

// Wait waits for the work and returns the collective's own error. After a collective over Go slices succeeds, the
// slice holds its result. It then releases the work (Close is not needed, and does nothing); a later Wait returns
// the same error.
func (w *Work) Wait() error {
	if w != nil && w.waited {
		return w.result
	}
	h := w.handle()
	err := call(func() int { return raw.Dpar_work_wait(h) })
	if h == nil { // nil or closed: dpar's refusal, nothing to deliver or release
		return err
	}
	if err == nil && w.deliver != nil {
		w.deliver()
	}
	w.Close()
	w.waited, w.result = true, err
	return err
}

// Close frees the work. As dpar_work_free does, it first waits for a collective that is still running, whose
// buffers dpar writes until it ends; the result of a collective over Go slices reaches the slice only through
// Wait, so that a finalizer never writes into memory the program is using. Close may be called again.
func (w *Work) Close() {
	if w == nil || w.raw == nil {
		return
	}
	raw.Dpar_work_free(w.raw)
	w.raw = nil
	freeC(w.staging) // the collective is over: dpar no longer uses it
	w.staging, w.deliver, w.comm = nil, nil, nil
	runtime.SetFinalizer(w, nil)
}

// handle is the work's dpar handle, nil for a nil or closed Work: dpar then refuses the call with its own message.
func (w *Work) handle() raw.Struct_SS_dpar_work {
	if w == nil {
		return nil
	}
	return w.raw
}
