package dpar

import (
	"fmt"
	"math"
	"math/rand"
	"testing"
	"unsafe"
)

// The gradients of the reducer tests, in forward order, and buckets of 256 bytes first and 2048 after: backward
// goes 4 (2052 bytes, over 256: a bucket), 3 and 2 (5056 bytes, over 2048: a bucket), then 1 and 0 (the rest).
var (
	gradSizes    = []int{300, 7, 1200, 64, 513}
	smallBuckets = ReducerOptions{FirstBucketBytes: 256, BucketCapBytes: 2048}
)

// gradValue is participant r's gradient k, element i, at step s: integers, so that sums are exact in float32.
func gradValue(r, k, i, step int) float32 { return float32((r+1)*8 + 3*k + step + i%5) }

// produces says whether participant r produces gradient k at step s of a group of n: the last participant never
// produces gradient 1 (a parameter its forward did not use), and participant 0 has no data at step 1.
func produces(r, k, step, n int) bool { return !(r == n-1 && k == 1) && !(r == 0 && step == 1) }

// backwardOrder is the order in which participant r produces its gradients at a step: backward's (the last
// first), shuffled differently for every participant and step; the buckets' launch order stays dpar's.
func backwardOrder(r, step int) []int {
	order := make([]int, len(gradSizes))
	for i := range order {
		order[i] = len(order) - 1 - i
	}
	rng := rand.New(rand.NewSource(int64(10*r + step)))
	rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	return order
}

// expectedGrad is gradient k's element i after step s: the sum over the participants that produced it (the
// others count as zero), divided by n for Mean.
func expectedGrad(k, i, step, n int, op ReduceOp) float32 {
	var sum float32
	for r := 0; r < n; r++ {
		if produces(r, k, step, n) {
			sum += gradValue(r, k, i, step)
		}
	}
	if op == Mean {
		return sum / float32(n)
	}
	return sum
}

// checkReduced compares a reduced gradient with expectedGrad: exactly for Sum; for Mean within a rounding of the
// exact quotient, since dpar may scale by 1/n rather than divide.
func checkReduced(got []float32, k, step, n int, op ReduceOp) error {
	for i, v := range got {
		want := expectedGrad(k, i, step, n, op)
		if v == want || (op == Mean && math.Abs(float64(v-want)) <= 1e-6*math.Abs(float64(want))) {
			continue
		}
		return fmt.Errorf("step %d, gradient %d, element %d: %v, expected %v", step, k, i, v, want)
	}
	return nil
}

// runSteps plays three training steps of one participant on a reducer over gradSizes: each produced gradient is
// written (through write) and marked in the participant's own order; the others are filled with NaN, which the
// reducer must ignore; after Wait every gradient (read through read) is checked.
func runSteps(red *Reducer, rank, n int, op ReduceOp, write func(k int) ([]float32, error)) error {
	for step := 0; step < 3; step++ {
		for _, k := range backwardOrder(rank, step) {
			g, err := write(k)
			if err != nil {
				return err
			}
			if !produces(rank, k, step, n) {
				for i := range g {
					g[i] = float32(math.NaN())
				}
				continue
			}
			for i := range g {
				g[i] = gradValue(rank, k, i, step)
			}
			if err := red.GradReady(k); err != nil {
				return fmt.Errorf("step %d, GradReady(%d): %w", step, k, err)
			}
		}
		if err := red.Wait(); err != nil {
			return fmt.Errorf("step %d, Wait: %w", step, err)
		}
		for k := range gradSizes {
			g, err := write(k)
			if err != nil {
				return err
			}
			if err := checkReduced(g, k, step, n, op); err != nil {
				return err
			}
		}
	}
	return nil
}

func TestTheReducerGivesTheSumOrMeanOfWhatEachMemberProduced(t *testing.T) {
	for _, maker := range groupMakers {
		for n := 2; n <= 4; n++ {
			for _, op := range []ReduceOp{Sum, Mean} {
				maker, n, op := maker, n, op
				t.Run(fmt.Sprintf("%s, %d members, %s", maker.name, n, opNames[op]), func(t *testing.T) {
					g, err := maker.make(n)
					if err != nil {
						t.Fatal(err)
					}
					defer g.Close()
					onEachMember(t, g, n, func(c *Comm, rank int) error {
						red, err := NewReducer(c, gradSizes, op, smallBuckets)
						if err != nil {
							return err
						}
						defer red.Close()
						if b, err := red.NumBuckets(); b != 3 || err != nil {
							return fmt.Errorf("NumBuckets: %d, %v; expected 3", b, err)
						}
						return runSteps(red, rank, n, op, func(k int) ([]float32, error) {
							g, err := red.Grad(k)
							if err != nil {
								return nil, fmt.Errorf("Grad(%d): %w", k, err)
							}
							return g, nil
						})
					})
				})
			}
		}
	}
}

// A program's own gradient memory (a GPU's, in a group made on CUDA devices): C memory on CPU devices here.
func TestTheReducerOverTheCallersMemory(t *testing.T) {
	const n = 3
	g, err := groupMakers[1].make(n)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	onEachMember(t, g, n, func(c *Comm, rank int) error {
		grads := make([][]float32, len(gradSizes))
		addresses := make([]unsafe.Pointer, len(gradSizes))
		for k, size := range gradSizes {
			memory, view, err := cBuffer[float32](size) // apart: the reducer stages buckets through its own copy
			if err != nil {
				return err
			}
			defer freeC(memory)
			grads[k], addresses[k] = view, memory
		}
		// One bucket per gradient: every bucket closes at its first gradient.
		red, err := NewReducerUnsafe(c, addresses, gradSizes, Mean, ReducerOptions{FirstBucketBytes: 1, BucketCapBytes: 1})
		if err != nil {
			return err
		}
		defer red.Close() // before the memory is freed: deferred calls run last first
		if b, err := red.NumBuckets(); b != len(gradSizes) || err != nil {
			return fmt.Errorf("NumBuckets: %d, %v; expected %d", b, err, len(gradSizes))
		}
		if _, err := red.Grad(0); !isDparError(err, ErrInvalidArg, "the caller's memory") {
			return fmt.Errorf("Grad of the caller's memory: %v", err)
		}
		return runSteps(red, rank, n, Mean, func(k int) ([]float32, error) { return grads[k], nil })
	})
}

func TestReducerOptionsReachDpar(t *testing.T) {
	c := soloComm(t)
	for _, check := range []struct {
		options ReducerOptions
		buckets int
	}{
		{ReducerOptions{}, 1}, // dpar's 1 MiB first bucket holds all 8 KiB
		{smallBuckets, 3},
		{ReducerOptions{FirstBucketBytes: 1, BucketCapBytes: 1}, len(gradSizes)},
		{ReducerOptions{FirstBucketBytes: 1 << 40, BucketCapBytes: 1}, 1},
	} {
		red, err := NewReducer(c, gradSizes, Sum, check.options)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := red.NumBuckets(); b != check.buckets || err != nil {
			t.Errorf("%+v: %d buckets, %v; expected %d", check.options, b, err, check.buckets)
		}
		red.Close()
	}
}

func TestBadReducerArgumentsAreErrorsWithDparsMessage(t *testing.T) {
	c := soloComm(t)
	memory, _, err := cBuffer[float32](40)
	if err != nil {
		t.Fatal(err)
	}
	defer freeC(memory)
	noReducer := func(_ *Reducer, err error) error { return err }
	noGrad := func(_ []float32, err error) error { return err }
	closed, err := NewReducer(c, []int{4}, Sum, ReducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	closed.Close()
	group, closedComm := soloGroup(t)
	defer group.Close()
	closedComm.Close()
	for _, check := range []struct {
		what    string
		err     error
		status  Status
		message string
	}{
		{"a negative count", noReducer(NewReducer(c, []int{10, -2}, Sum, ReducerOptions{})), ErrInvalidArg,
			"counts[1]: -2 is negative"},
		{"a negative bucket size", noReducer(NewReducer(c, []int{10}, Sum, ReducerOptions{BucketCapBytes: -1})),
			ErrInvalidArg, "BucketCapBytes: -1 is negative"},
		{"addresses and counts of different lengths", noReducer(NewReducerUnsafe(c, []unsafe.Pointer{memory},
			[]int{10, 10}, Sum, ReducerOptions{})), ErrInvalidArg, "counts: 2 elements, expected 1"},
		// dpar's own refusals.
		{"an empty gradient", noReducer(NewReducer(c, []int{10, 0}, Sum, ReducerOptions{})), ErrInvalidArg,
			"counts[1]: is 0"},
		{"no gradient", noReducer(NewReducer(c, nil, Sum, ReducerOptions{})), ErrInvalidArg, "num_grads"},
		{"an op that is neither Sum nor Mean", noReducer(NewReducer(c, []int{10}, Max, ReducerOptions{})),
			ErrInvalidArg, "opts.op: 2 must be DPAR_SUM or DPAR_MEAN"},
		{"a nil Comm", noReducer(NewReducer(nil, []int{10}, Sum, ReducerOptions{})), ErrInvalidArg,
			"comm: handle is NULL"},
		{"a closed Comm as the processes'", noReducer(NewReducer(c, []int{10}, Sum,
			ReducerOptions{Processes: closedComm})), ErrInvalidArg, "Processes: the communicator is closed"},
		// Refusals that show that Processes and Compression reach dpar.
		{"the reducer's own Comm as the processes'", noReducer(NewReducer(c, []int{10}, Sum,
			ReducerOptions{Processes: c})), ErrInvalidArg, "opts.processes: is the reducer's own communicator"},
		{"an unknown compression", noReducer(NewReducer(c, []int{10}, Sum, ReducerOptions{Compression: 7})),
			ErrInvalidArg, "opts.compression: 7 is not a gradient compression"},
		{"overlapping gradients", noReducer(NewReducerUnsafe(c, []unsafe.Pointer{memory, unsafe.Add(memory, 20)},
			[]int{10, 10}, Sum, ReducerOptions{})), ErrInvalidArg, "grads[0] and grads[1]: the buffers overlap"},
		{"a NULL gradient", noReducer(NewReducerUnsafe(c, []unsafe.Pointer{memory, nil}, []int{10, 10}, Sum,
			ReducerOptions{})), ErrInvalidArg, "grads[1]: is NULL"},
		{"a closed Reducer's GradReady", closed.GradReady(0), ErrInvalidArg, "reducer: handle is NULL"},
		{"a closed Reducer's Wait", closed.Wait(), ErrInvalidArg, "reducer: handle is NULL"},
		{"a closed Reducer's Grad", noGrad(closed.Grad(0)), ErrInvalidArg, "Grad: the reducer is closed"},
		{"a nil Reducer's Wait", (*Reducer)(nil).Wait(), ErrInvalidArg, "reducer: handle is NULL"},
		{"a nil Reducer's NumBuckets", noCount((*Reducer)(nil).NumBuckets()), ErrInvalidArg,
			"reducer: handle is NULL"},
	} {
		if !isDparError(check.err, check.status, check.message) {
			t.Errorf("%s: got %v, expected %s and %q", check.what, check.err, StatusName(check.status), check.message)
		}
	}
	(*Reducer)(nil).Close()

	// Refusals in a step leave it going: gradient 1 counts, gradient 0 (never marked) is zero.
	red, err := NewReducer(c, []int{10, 20}, Sum, ReducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer red.Close()
	g0, _ := red.Grad(0)
	g1, _ := red.Grad(1)
	for i := range g0 {
		g0[i] = 3
	}
	for i := range g1 {
		g1[i] = 5
	}
	if err := red.GradReady(1); err != nil {
		t.Fatal(err)
	}
	for _, check := range []struct {
		what    string
		err     error
		status  Status
		message string
	}{
		{"a second mark", red.GradReady(1), ErrInvalidState, "gradient 1 was marked ready twice in one step"},
		{"an index past the last", red.GradReady(2), ErrInvalidArg, "index: 2 is out of range (2 gradients"},
		{"a negative index", red.GradReady(-1), ErrInvalidArg, "index: -1 is negative"},
		{"Grad of a gradient marked ready", noGrad(red.Grad(1)), ErrInvalidState, "gradient 1 is marked ready"},
		{"Grad past the last", noGrad(red.Grad(2)), ErrInvalidArg, "index: 2 is out of range"},
	} {
		if !isDparError(check.err, check.status, check.message) {
			t.Errorf("%s: got %v, expected %s and %q", check.what, check.err, StatusName(check.status), check.message)
		}
	}
	if err := red.Wait(); err != nil {
		t.Fatal(err)
	}
	if g1, err = red.Grad(1); err != nil {
		t.Fatalf("Grad after Wait: %v", err)
	}
	for i := range g0 {
		if g0[i] != 0 {
			t.Fatalf("gradient 0, never marked, holds %v", g0)
		}
	}
	for i := range g1 {
		if g1[i] != 5 {
			t.Fatalf("gradient 1 holds %v", g1)
		}
	}
}

func noCount(_ int, err error) error { return err }

// dpar keeps the communicator for the reducer: the Comm may be closed first.
func TestTheReducerOutlivesItsComm(t *testing.T) {
	g, c := soloGroup(t)
	defer g.Close()
	red, err := NewReducer(c, []int{100}, Mean, ReducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer red.Close()
	c.Close()
	grad, _ := red.Grad(0)
	for i := range grad {
		grad[i] = 2
	}
	if err := red.GradReady(0); err != nil {
		t.Fatal(err)
	}
	if err := red.Wait(); err != nil {
		t.Fatal(err)
	}
	if grad[99] != 2 {
		t.Fatalf("the mean over one member: %v", grad[99])
	}
}

// Without mpirun, NewMPIComm is rank 0 of a job of one process, over which nothing crosses: a group's reducers
// over it give the group's mean, which bfloat16 does not round (a 1/1024 beside numbers of 8 to 32 would not
// survive bfloat16's 8 significant bits).
func TestAReducerOverTheProcessesOfAJobOfOneGivesTheGroupsMean(t *testing.T) {
	processes, err := NewMPIComm(30)
	if err != nil {
		t.Fatal(err)
	}
	defer processes.Close()
	if rank, size, err := processes.Info(); rank != 0 || size != 1 || err != nil {
		t.Fatalf("NewMPIComm without mpirun: rank %d of %d, %v; expected rank 0 of 1", rank, size, err)
	}
	const n, fraction = 2, 1.0 / 1024
	onEachMember(t, testGroup(t, n, 30), n, func(c *Comm, rank int) error {
		o := smallBuckets
		o.Processes, o.Compression = processes, CompressionBF16
		red, err := NewReducer(c, gradSizes, Mean, o)
		if err != nil {
			return err
		}
		defer red.Close()
		for k := len(gradSizes) - 1; k >= 0; k-- {
			g, err := red.Grad(k)
			if err != nil {
				return err
			}
			for i := range g {
				g[i] = gradValue(rank, k, i, 0) + fraction
			}
			if err := red.GradReady(k); err != nil {
				return err
			}
		}
		if err := red.Wait(); err != nil {
			return err
		}
		for k := range gradSizes {
			g, _ := red.Grad(k)
			for i, v := range g {
				if want := (gradValue(0, k, i, 0)+gradValue(1, k, i, 0))/2 + fraction; v != want {
					return fmt.Errorf("gradient %d, element %d: %v, expected %v", k, i, v, want)
				}
			}
		}
		return nil
	})
}

// A member that never ends its step: the others' Wait returns dpar's timeout, naming it.
func TestAReducersWaitNamesAMemberThatNeverCame(t *testing.T) {
	g := testGroup(t, 3, 0.5)
	onEachMember(t, g, 3, func(c *Comm, rank int) error {
		red, err := NewReducer(c, []int{1000, 1000}, Sum, smallBuckets)
		if err != nil {
			return err
		}
		defer red.Close()
		if rank == 1 {
			return nil
		}
		if err := firstError(red.GradReady(1), red.GradReady(0)); err != nil {
			return err
		}
		err = red.Wait()
		// The first to give up reports the timeout; one that finds the group given up on reports ErrRemote.
		if !isDparError(err, ErrTimeout, "participant 1") && !isDparError(err, ErrRemote, "participant 1") {
			return fmt.Errorf("Wait: %v", err)
		}
		return nil
	})
}

// testGroup is a group of size participants, closed when the test ends.
func testGroup(t *testing.T, size int, timeoutSeconds float64) *CommGroup {
	t.Helper()
	g, err := NewCommGroup(size, timeoutSeconds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	return g
}

// soloGroup is a group of one and its member, for tests of one participant's calls.
func soloGroup(t *testing.T) (*CommGroup, *Comm) {
	t.Helper()
	g, err := NewCommGroup(1, 30)
	if err != nil {
		t.Fatal(err)
	}
	c, err := g.Member(0)
	if err != nil {
		g.Close()
		t.Fatal(err)
	}
	return g, c
}

// soloComm is the member of a group of one, closed (with its group) when the test ends.
func soloComm(t *testing.T) *Comm {
	g, c := soloGroup(t)
	t.Cleanup(func() {
		c.Close()
		g.Close()
	})
	return c
}
