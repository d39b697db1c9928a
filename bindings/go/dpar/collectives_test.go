package dpar

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

// groupMakers make a group of n both ways: NewCommGroup, and NewCommGroupOnDevices over CPU devices, the path a
// group on GPUs takes (its buffers host memory here).
var groupMakers = []struct {
	name string
	make func(n int) (*CommGroup, error)
}{
	{"plain", func(n int) (*CommGroup, error) { return NewCommGroup(n, 30) }},
	{"on CPU devices", func(n int) (*CommGroup, error) {
		devices := make([][2]int, n)
		for r := range devices {
			devices[r] = [2]int{int(CPU), r}
		}
		return NewCommGroupOnDevices(devices, nil, 30)
	}},
}

// onEachMember runs body for every member of g, each on a goroutine of its own. A member whose body fails aborts
// the group with its error, so that the others stop waiting for it.
func onEachMember(t *testing.T, g *CommGroup, n int, body func(c *Comm, rank int) error) {
	t.Helper()
	comms := make([]*Comm, n)
	for r := range comms {
		var err error
		if comms[r], err = g.Member(r); err != nil {
			t.Fatal(err)
		}
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			if errs[r] = body(comms[r], r); errs[r] != nil {
				comms[r].Abort(errs[r].Error())
			}
		}(r)
	}
	wg.Wait()
	for r, c := range comms {
		if errs[r] != nil {
			t.Errorf("member %d of %d: %v", r, n, errs[r])
		}
		c.Close()
	}
}

// valueOf is participant r's element i: small integers of both signs, exact in every type, that differ between
// participants so that a wrong op, block or rank shows. Element 0 sums to -(n+1) over n participants, which n does
// not divide: an integer mean truncates it toward zero (-1, where rounding down gives -2).
func valueOf[T Element](r, i int) T {
	if i == 0 {
		if r == 0 {
			return -2
		}
		return -1
	}
	return T((r*37+i*11+5)%23 - 11)
}

// reduced is what op makes of element i over n participants, as dpar.h defines it: the sum in rank order, divided
// by n for Mean (integers truncated toward zero, as Go's division does).
func reduced[T Element](op ReduceOp, n, i int) T {
	acc := valueOf[T](0, i)
	for r := 1; r < n; r++ {
		v := valueOf[T](r, i)
		switch op {
		case Sum, Mean:
			acc += v
		case Max:
			if v > acc {
				acc = v
			}
		case Min:
			if v < acc {
				acc = v
			}
		}
	}
	if op == Mean {
		acc /= T(n)
	}
	return acc
}

var opNames = map[ReduceOp]string{Sum: "sum", Mean: "mean", Max: "max", Min: "min"}

// way is one way of running the collectives, so that one set of checks covers them all.
type way[T Element] struct {
	name          string
	allReduce     func(c *Comm, send, recv []T, op ReduceOp) error
	broadcast     func(c *Comm, buf []T, root int) error
	reduce        func(c *Comm, send, recv []T, op ReduceOp, root int) error
	allGather     func(c *Comm, send, recv []T) error
	reduceScatter func(c *Comm, send, recv []T, op ReduceOp) error
}

// waited waits for a work that start returned, and checks what Test says after it.
func waited(w *Work, err error) error {
	if err != nil {
		return err
	}
	if _, err := w.Test(); err != nil {
		return fmt.Errorf("Test before Wait: %w", err)
	}
	if err := w.Wait(); err != nil {
		return err
	}
	if done, err := w.Test(); !done || err != nil {
		return fmt.Errorf("Test after Wait: %v, %v", done, err)
	}
	return nil
}

// atAddresses runs f on copies of send and recv in C memory, then copies recv back: the *Unsafe collectives on
// memory that is not Go's, as a GPU's is not.
func atAddresses[T Element](send, recv []T, f func(send, recv unsafe.Pointer) error) error {
	sendMemory, sendCopy, err := cBuffer[T](len(send))
	if err != nil {
		return err
	}
	defer freeC(sendMemory)
	recvMemory, recvCopy, err := cBuffer[T](len(recv))
	if err != nil {
		return err
	}
	defer freeC(recvMemory)
	copy(sendCopy, send)
	if err := f(sendMemory, recvMemory); err != nil {
		return err
	}
	copy(recv, recvCopy)
	return nil
}

func ways[T Element]() []way[T] {
	dtype := dtypeOf[T]()
	return []way[T]{
		{"Go slices", AllReduce[T], Broadcast[T], Reduce[T], AllGather[T], ReduceScatter[T]},
		{
			name: "Go slices, asynchronously",
			allReduce: func(c *Comm, send, recv []T, op ReduceOp) error {
				copy(recv, send)
				return waited(AllReduceAsync(c, recv, op))
			},
			broadcast: func(c *Comm, buf []T, root int) error { return waited(BroadcastAsync(c, buf, root)) },
			reduce:    Reduce[T], // dpar has no asynchronous reduce
			allGather: func(c *Comm, send, recv []T) error { return waited(AllGatherAsync(c, send, recv)) },
			reduceScatter: func(c *Comm, send, recv []T, op ReduceOp) error {
				return waited(ReduceScatterAsync(c, send, recv, op))
			},
		},
		{
			name: "addresses",
			allReduce: func(c *Comm, send, recv []T, op ReduceOp) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return c.AllReduceUnsafe(s, r, len(send), dtype, op)
				})
			},
			broadcast: func(c *Comm, buf []T, root int) error {
				return atAddresses(nil, buf, func(_, p unsafe.Pointer) error {
					copy(unsafe.Slice((*T)(p), len(buf)), buf)
					return c.BroadcastUnsafe(p, len(buf), dtype, root)
				})
			},
			reduce: func(c *Comm, send, recv []T, op ReduceOp, root int) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return c.ReduceUnsafe(s, r, len(send), dtype, op, root)
				})
			},
			allGather: func(c *Comm, send, recv []T) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return c.AllGatherUnsafe(s, r, len(send), dtype)
				})
			},
			reduceScatter: func(c *Comm, send, recv []T, op ReduceOp) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return c.ReduceScatterUnsafe(s, r, len(recv), dtype, op)
				})
			},
		},
		{
			name: "addresses, asynchronously",
			allReduce: func(c *Comm, send, recv []T, op ReduceOp) error {
				copy(recv, send)
				return atAddresses(nil, recv, func(_, p unsafe.Pointer) error {
					copy(unsafe.Slice((*T)(p), len(recv)), recv)
					return waited(c.AllReduceAsyncUnsafe(p, p, len(recv), dtype, op)) // in place
				})
			},
			broadcast: func(c *Comm, buf []T, root int) error {
				return atAddresses(nil, buf, func(_, p unsafe.Pointer) error {
					copy(unsafe.Slice((*T)(p), len(buf)), buf)
					return waited(c.BroadcastAsyncUnsafe(p, len(buf), dtype, root))
				})
			},
			reduce: func(c *Comm, send, recv []T, op ReduceOp, root int) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return c.ReduceUnsafe(s, r, len(send), dtype, op, root)
				})
			},
			allGather: func(c *Comm, send, recv []T) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return waited(c.AllGatherAsyncUnsafe(s, r, len(send), dtype))
				})
			},
			reduceScatter: func(c *Comm, send, recv []T, op ReduceOp) error {
				return atAddresses(send, recv, func(s, r unsafe.Pointer) error {
					return waited(c.ReduceScatterAsyncUnsafe(s, r, len(recv), dtype, op))
				})
			},
		},
	}
}

// checkCollectives runs every collective one way, with every op, and compares with reduced and valueOf.
func checkCollectives[T Element](c *Comm, rank, n int, w way[T]) error {
	const count = 5
	send := make([]T, count)
	for i := range send {
		send[i] = valueOf[T](rank, i)
	}
	mismatch := func(what string, got, want any) error {
		return fmt.Errorf("%s: %v, expected %v", what, got, want)
	}
	for _, op := range []ReduceOp{Sum, Mean, Max, Min} {
		recv := make([]T, count)
		if err := w.allReduce(c, send, recv, op); err != nil {
			return fmt.Errorf("all-reduce (%s): %w", opNames[op], err)
		}
		for i := range recv {
			if want := reduced[T](op, n, i); recv[i] != want {
				return mismatch(fmt.Sprintf("all-reduce (%s) element %d", opNames[op], i), recv[i], want)
			}
		}
		// Into the last participant (root 0 would hide a root taken as 0); recv is nil elsewhere.
		root := n - 1
		var into []T
		if rank == root {
			into = make([]T, count)
		}
		if err := w.reduce(c, send, into, op, root); err != nil {
			return fmt.Errorf("reduce (%s): %w", opNames[op], err)
		}
		for i := range into {
			if want := reduced[T](op, n, i); into[i] != want {
				return mismatch(fmt.Sprintf("reduce (%s) element %d", opNames[op], i), into[i], want)
			}
		}
		// Blocks of 2: participant r's block b holds its elements 2b and 2b+1.
		blocks := make([]T, 2*n)
		for i := range blocks {
			blocks[i] = valueOf[T](rank, i)
		}
		mine := make([]T, 2)
		if err := w.reduceScatter(c, blocks, mine, op); err != nil {
			return fmt.Errorf("reduce-scatter (%s): %w", opNames[op], err)
		}
		for e := range mine {
			if want := reduced[T](op, n, 2*rank+e); mine[e] != want {
				return mismatch(fmt.Sprintf("reduce-scatter (%s) element %d", opNames[op], e), mine[e], want)
			}
		}
	}
	buf := append([]T(nil), send...)
	if err := w.broadcast(c, buf, 1); err != nil {
		return fmt.Errorf("broadcast: %w", err)
	}
	for i := range buf {
		if want := valueOf[T](1, i); buf[i] != want {
			return mismatch(fmt.Sprintf("broadcast element %d", i), buf[i], want)
		}
	}
	all := make([]T, n*count)
	if err := w.allGather(c, send, all); err != nil {
		return fmt.Errorf("all-gather: %w", err)
	}
	for i := range all {
		if want := valueOf[T](i/count, i%count); all[i] != want {
			return mismatch(fmt.Sprintf("all-gather element %d", i), all[i], want)
		}
	}
	return nil
}

func checkEveryWay[T Element](c *Comm, rank, n int) error {
	for _, w := range ways[T]() {
		if err := checkCollectives(c, rank, n, w); err != nil {
			var zero T
			return fmt.Errorf("%T, %s: %w", zero, w.name, err)
		}
	}
	return nil
}

func TestEveryCollectiveGivesTheReferenceForEveryTypeOpAndWay(t *testing.T) {
	for _, maker := range groupMakers {
		for n := 2; n <= 4; n++ {
			maker, n := maker, n
			t.Run(fmt.Sprintf("%s, %d members", maker.name, n), func(t *testing.T) {
				g, err := maker.make(n)
				if err != nil {
					t.Fatal(err)
				}
				defer g.Close()
				onEachMember(t, g, n, func(c *Comm, rank int) error {
					for _, check := range []func(*Comm, int, int) error{
						checkEveryWay[float32], checkEveryWay[float64], checkEveryWay[int32], checkEveryWay[int64],
					} {
						if err := check(c, rank, n); err != nil {
							return err
						}
					}
					return nil
				})
			})
		}
	}
}

// Work started on one communicator runs in order and may be waited for in any order; the slices are the caller's
// until Wait, which alone writes the result into them.
func TestAsyncWorkOverGoSlices(t *testing.T) {
	g := testGroup(t, 2, 30)
	onEachMember(t, g, 2, func(c *Comm, rank int) error {
		a := make([]float32, 4096)
		b := make([]int64, 4096)
		for i := range a {
			a[i], b[i] = float32(rank+1), int64(10*(rank+1))
		}
		wa, err := AllReduceAsync(c, a, Sum)
		if err != nil {
			return err
		}
		wb, err := AllReduceAsync(c, b, Sum)
		if err != nil {
			return err
		}
		a[17] = 1000 // the collective reduces the values a held when it started
		if err := wb.Wait(); err != nil {
			return err
		}
		if err := wa.Wait(); err != nil {
			return err
		}
		for i := range a {
			if a[i] != 3 || b[i] != 30 {
				return fmt.Errorf("element %d: %v and %v, expected 3 and 30", i, a[i], b[i])
			}
		}
		if done, err := wa.Test(); !done || err != nil {
			return fmt.Errorf("Test after Wait: %v, %v", done, err)
		}
		wa.Close() // nothing left to free after Wait
		if err := wa.Wait(); err != nil {
			return fmt.Errorf("a second Wait: %v", err)
		}
		// Close without Wait waits for the collective, then frees it: the slice keeps its values.
		kept := []float64{float64(rank)}
		w, err := AllReduceAsync(c, kept, Sum)
		if err != nil {
			return err
		}
		w.Close()
		w.Close()
		if kept[0] != float64(rank) {
			return fmt.Errorf("Close wrote %v into the slice", kept[0])
		}
		if err := w.Wait(); !isDparError(err, ErrInvalidArg, "work: handle is NULL") {
			return fmt.Errorf("Wait after Close: %v", err)
		}
		if _, err := w.Test(); !isDparError(err, ErrInvalidArg, "work: handle is NULL") {
			return fmt.Errorf("Test after Close: %v", err)
		}
		// Empty slices are collectives of no element.
		return waited(AllGatherAsync(c, []int32{}, nil))
	})
}

func isDparError(err error, status Status, message string) bool {
	var de *Error
	return errors.As(err, &de) && de.Status == status && strings.Contains(de.Message, message)
}

func TestBadCollectiveArgumentsAreErrorsWithDparsMessage(t *testing.T) {
	g := testGroup(t, 2, 30)
	noWork := func(_ *Work, err error) error { return err }
	noDone := func(_ bool, err error) error { return err }
	// Member 0 alone: every refusal comes before a participant waits for another.
	onEachMember(t, g, 2, func(c *Comm, rank int) error {
		if rank == 1 {
			return nil
		}
		x := []float32{1, 2}
		memory, _, err := cBuffer[float32](2)
		if err != nil {
			return err
		}
		defer freeC(memory)
		for _, check := range []struct {
			what    string
			err     error
			status  Status
			message string
		}{
			{"a longer recv", AllReduce(c, x, make([]float32, 3), Sum), ErrInvalidArg, "recv: 3 elements, expected 2"},
			{"reduce's recv", Reduce(c, []int32{1, 2}, []int32{0}, Sum, 0), ErrInvalidArg, "recv: 1 elements, expected 2"},
			{"all-gather's recv", AllGather(c, []int64{1, 2}, make([]int64, 3)), ErrInvalidArg, "recv: 3 elements, expected 4"},
			{"reduce-scatter's send", ReduceScatter(c, make([]float64, 3), make([]float64, 2), Sum), ErrInvalidArg,
				"send: 3 elements, expected 4"},
			{"asynchronous all-gather's recv", noWork(AllGatherAsync(c, x, x)), ErrInvalidArg, "recv: 2 elements, expected 4"},
			{"asynchronous reduce-scatter's send", noWork(ReduceScatterAsync(c, x, x, Sum)), ErrInvalidArg,
				"send: 2 elements, expected 4"},
			{"a negative root", Broadcast(c, x, -1), ErrInvalidArg, "root: -1 is negative"},
			{"a negative count", c.AllGatherUnsafe(memory, memory, -1, F32), ErrInvalidArg, "count: -1 is negative"},
			// dpar's own refusals.
			{"an unknown op", AllReduce(c, x, x, 9), ErrInvalidArg, "op: unknown reduction 9"},
			{"a root past the last", Broadcast(c, []int64{1}, 2), ErrInvalidArg, "root: 2 is out of range"},
			{"the root's missing recv", Reduce(c, x, nil, Max, 0), ErrInvalidArg, "recv: is NULL"},
			{"an unknown dtype", c.AllReduceUnsafe(memory, memory, 2, 77, Sum), ErrInvalidArg, "dtype: unknown dtype 77"},
			{"a reserved dtype", c.ReduceScatterUnsafe(memory, memory, 1, 2, Sum), ErrNotSupported, "dtype: 2"},
			{"a NULL send", c.AllReduceUnsafe(nil, memory, 2, F32, Sum), ErrInvalidArg, "send: is NULL"},
			{"an asynchronous unknown op", noWork(AllReduceAsync(c, x, -3)), ErrInvalidArg, "op: unknown reduction -3"},
			{"an asynchronous root past the last", noWork(BroadcastAsync(c, x, 5)), ErrInvalidArg, "root: 5 is out of range"},
			{"an asynchronous NULL buffer", noWork(c.BroadcastAsyncUnsafe(nil, 2, I32, 0)), ErrInvalidArg, "buffer: is NULL"},
			{"a nil Comm", AllReduce(nil, x, x, Sum), ErrInvalidArg, "comm: handle is NULL"},
			{"a nil Comm's all-gather", AllGather(nil, x, x), ErrInvalidArg, "comm: handle is NULL"},
			{"a nil Comm's asynchronous work", noWork(AllReduceAsync(nil, x, Sum)), ErrInvalidArg, "comm: handle is NULL"},
			{"a nil Work's Wait", (*Work)(nil).Wait(), ErrInvalidArg, "work: handle is NULL"},
			{"a nil Work's Test", noDone((*Work)(nil).Test()), ErrInvalidArg, "work: handle is NULL"},
		} {
			if !isDparError(check.err, check.status, check.message) {
				return fmt.Errorf("%s: got %v, expected %s and %q", check.what, check.err, StatusName(check.status),
					check.message)
			}
		}
		(*Work)(nil).Close()
		return nil
	})
	// A group of one: collectives of no element, then a closed communicator.
	one, err := NewCommGroup(1, 30)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	c, err := one.Member(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.AllReduceFloat32(nil, Sum); err != nil {
		t.Fatalf("an empty all-reduce: %v", err)
	}
	if err := ReduceScatter(c, []int32{}, nil, Min); err != nil {
		t.Fatalf("an empty reduce-scatter: %v", err)
	}
	c.Close()
	c.Close()
	if err := Broadcast(c, []float64{1}, 0); !isDparError(err, ErrInvalidArg, "comm: handle is NULL") {
		t.Fatalf("a closed Comm: %v", err)
	}
	if _, err := BroadcastAsync(c, []float64{1}, 0); !isDparError(err, ErrInvalidArg, "comm: handle is NULL") {
		t.Fatalf("a closed Comm's asynchronous work: %v", err)
	}
}

// A failed collective's error comes back from Wait with dpar's message: participants that disagree on the count,
// then a participant that never arrives.
func TestAWorksErrorIsTheCollectives(t *testing.T) {
	g := testGroup(t, 2, 30)
	onEachMember(t, g, 2, func(c *Comm, rank int) error {
		w, err := AllReduceAsync(c, make([]float64, 3+rank), Sum)
		if err != nil {
			return err
		}
		if err := w.Wait(); !isDparError(err, ErrMismatch, "participant 1") {
			return fmt.Errorf("counts 3 and 4: %v", err)
		}
		return nil
	})
	late, err := NewCommGroup(2, 0.2)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	onEachMember(t, late, 2, func(c *Comm, rank int) error {
		if rank == 0 {
			return nil // never joins
		}
		w, err := BroadcastAsync(c, []int32{7}, 1)
		if err != nil {
			return err
		}
		if err := w.Wait(); !isDparError(err, ErrTimeout, "participant 0") {
			return fmt.Errorf("a participant that never arrives: %v", err)
		}
		if err := c.AsyncError(); err == nil {
			return errors.New("the failed work does not show as the communicator's error")
		}
		return nil
	})
}
