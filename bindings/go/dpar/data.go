package dpar

import (
	"runtime"
	"unsafe"

	"dpar.dev/go/raw"
)

// Dataset is a labelled dataset in dpar's memory (IDX files: MNIST, Fashion-MNIST).
type Dataset struct {
	raw raw.Struct_SS_dpar_dataset
}

// LoadIDX loads an IDX image file and its label file (gzip or not).
func LoadIDX(imagesPath, labelsPath string) (*Dataset, error) {
	var p uintptr
	if err := call(func() int { return raw.Dpar_dataset_load_idx(unsafe.Pointer(&p), imagesPath, labelsPath) }); err != nil {
		return nil, err
	}
	d := &Dataset{raw: raw.SwigcptrStruct_SS_dpar_dataset(p)}
	runtime.SetFinalizer(d, (*Dataset).Close)
	return d, nil
}

// Close frees the dataset; its loaders must be closed first.
func (d *Dataset) Close() { release(d, &d.raw, raw.Dpar_dataset_free) }

// Info is the number of samples, features per sample and classes.
func (d *Dataset) Info() (samples, features, classes int, err error) {
	var s, f, c uint64
	err = call(func() int {
		return raw.Dpar_dataset_info(unsafe.Pointer(&s), unsafe.Pointer(&f), unsafe.Pointer(&c), d.raw)
	})
	runtime.KeepAlive(d)
	return int(s), int(f), int(c), err
}

// Normalize maps every feature x to (x - mean) / std.
func (d *Dataset) Normalize(mean, std float32) error {
	defer runtime.KeepAlive(d)
	return call(func() int { return raw.Dpar_dataset_normalize(d.raw, mean, std) })
}

// Loader iterates over a dataset in batches, shuffled per epoch from its seed.
type Loader struct {
	raw     raw.Struct_SS_dpar_loader
	dataset *Dataset // kept alive while the loader is open
}

// NewLoader makes a loader of batchSize rows over d.
func NewLoader(d *Dataset, batchSize int, shuffle bool, seed uint64, dropLast bool) (*Loader, error) {
	var p uintptr
	err := call(func() int {
		return raw.Dpar_loader_create(unsafe.Pointer(&p), d.raw, int64(batchSize), b2i(shuffle), seed, b2i(dropLast))
	})
	if err != nil {
		return nil, err
	}
	l := &Loader{raw: raw.SwigcptrStruct_SS_dpar_loader(p), dataset: d}
	runtime.SetFinalizer(l, (*Loader).Close)
	return l, nil
}

// Close frees the loader and its batches.
func (l *Loader) Close() {
	release(l, &l.raw, raw.Dpar_loader_free)
	l.dataset = nil
}

// StartEpoch rewinds the loader and draws the epoch's order (from the seed and epoch).
func (l *Loader) StartEpoch(epoch uint64) error {
	defer runtime.KeepAlive(l)
	return call(func() int { return raw.Dpar_loader_start_epoch(l.raw, epoch) })
}

// NumBatches is the number of batches per epoch.
func (l *Loader) NumBatches() (int, error) {
	defer runtime.KeepAlive(l)
	var n uint64
	err := call(func() int { return raw.Dpar_loader_num_batches(unsafe.Pointer(&n), l.raw) })
	return int(n), err
}

// Shard makes the loader yield only shard's slice of each batch (one process of numShards).
func (l *Loader) Shard(shard, numShards int) error {
	defer runtime.KeepAlive(l)
	return call(func() int { return raw.Dpar_loader_shard(l.raw, int64(shard), int64(numShards)) })
}

// ToDevice makes the loader yield, from the next batch on, batches in memory of the device (kind, index), each
// prepared (on a GPU: copied) while the caller still uses the one before. The batches are the same, bit for bit.
func (l *Loader) ToDevice(kind DeviceKind, index int) error {
	defer runtime.KeepAlive(l)
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	d.SetKind(int(kind))
	d.SetIndex(index)
	return call(func() int { return raw.Dpar_loader_to_device(l.raw, d) })
}

// Next is the next batch's inputs and labels, borrowed from the loader until the following call (ok false at the
// end of the epoch).
func (l *Loader) Next() (inputs, labels *Tensor, ok bool, err error) {
	defer runtime.KeepAlive(l)
	var more int32
	if err = call(func() int { return raw.Dpar_loader_next(unsafe.Pointer(&more), l.raw) }); err != nil || more == 0 {
		return nil, nil, false, err
	}
	// Each batch holds l: a caller that keeps only the batch must not see l finalized, and its batch freed, under
	// a call that reads it.
	inputs = &Tensor{raw: raw.Dpar_loader_inputs(l.raw), borrowed: true, parent: l}
	labels = &Tensor{raw: raw.Dpar_loader_labels(l.raw), borrowed: true, parent: l}
	return inputs, labels, true, nil
}
