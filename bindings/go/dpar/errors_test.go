package dpar

import (
	"errors"
	"fmt"
	"testing"
)

func TestErrorsWorkWithErrorsIsAndAs(t *testing.T) {
	_, _, err := ParseDevice("tpu:1")
	if !errors.Is(err, ErrInvalidArg) || errors.Is(err, ErrTimeout) {
		t.Fatalf("errors.Is(%v, ErrInvalidArg) should hold and ErrTimeout not", err)
	}
	wrapped := fmt.Errorf("loading the model: %w", err)
	var status Status
	if !errors.As(wrapped, &status) || status != ErrInvalidArg {
		t.Fatalf("errors.As(%v, *Status) = %v", wrapped, status)
	}
	var de *Error
	if !errors.As(wrapped, &de) || de.Message == "" {
		t.Fatalf("errors.As(%v, **Error) = %v", wrapped, de)
	}
	if ErrTimeout.Error() != "DPAR_ERR_TIMEOUT" {
		t.Fatalf("ErrTimeout.Error() = %q", ErrTimeout.Error())
	}
}

// A hook's error keeps its status through wrapping (errors.As), and a bare Status is an error of that status.
func TestAHooksWrappedStatusReachesTheCaller(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	x, y := referenceBatch(t)
	for _, hookErr := range []error{fmt.Errorf("replica busy: %w", ErrTimeout), ErrTimeout} {
		if err := e.SetForwardHook(func(int, []int64, []int64) error { return hookErr }); err != nil {
			t.Fatal(err)
		}
		if _, err := e.TrainStep(x, y); !errors.Is(err, ErrTimeout) {
			t.Fatalf("hook returning %v: the step returned %v, want ErrTimeout", hookErr, err)
		}
	}
}
