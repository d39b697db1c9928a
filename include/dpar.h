/**
 * @file dpar.h
 * @brief dpar: data-parallel training of neural networks behind a stable C ABI.
 *
 * This is the one header to include. It includes one header per topic, under dpar/ (as libgit2's git2.h
 * includes those under git2/), where each topic's declarations are documented; each of them also compiles alone.
 *
 * Conventions (they hold for every declaration of every topic):
 *  - Every fallible call returns a ::dpar_status, a fixed-width integer (int32_t) whose values are the
 *    ::dpar_status_code constants; ::DPAR_OK is 0 and every error is negative. A library newer than the caller may
 *    return a code the caller does not know: treat any negative value as an error. The message of the last failed
 *    call on the calling thread is returned by dpar_last_error(); a callback sets it with dpar_set_error().
 *  - Ownership: a handle returned through a `**out` parameter is always owned by the caller and released with its
 *    `_free` function; every `_free` function accepts NULL. A pointer returned as a function's value is borrowed
 *    from its parent, valid as long as the parent lives (and, where said, until the parent's next call); no borrowed
 *    pointer is ever returned through an output parameter.
 *  - Integers: booleans are `int32_t` (0 false, nonzero true; dpar writes 0 or 1); counts, indices, sizes, ranks
 *    and replicas are `size_t`; tensor extents (shapes) and layer widths are `int64_t`, as in DLPack; enumerated
 *    values (dtypes, kinds, ops) and device indices are `int32_t`; versions are `uint32_t`.
 *  - Every `void *payload` given to dpar comes with an optional destructor (::dpar_destroy_fn) that dpar calls exactly
 *    once, when it no longer needs the payload (sqlite3's xDestroy).
 *  - Output parameters come first, then the handle, then the other arguments.
 *  - Option structs are versioned: initialise them with their `_INIT` macro or `_init()`, then set fields. `_init()`
 *    is a macro that passes the struct's size as the caller compiled it (`_init_sized()`): a newer library fills
 *    the caller's layout, and reads it back by its `size` and `version`. A binding that cannot use C macros calls
 *    `_init_sized()` with its own size of the struct. A program built against this header needs a libdpar of at
 *    least its MAJOR.MINOR version (#DPAR_VERSION_MINOR grows with every function added).
 *  - A NULL handle, a freed one or one of another type is refused with ::DPAR_ERR_INVALID_ARGUMENT: dpar looks every
 *    handle up among the live ones before using it. (A freed handle whose address a new handle of the same type
 *    has reused cannot be told apart from it.)
 *  - Thread-safety: every function may be called from any thread. A single handle must not be used by two
 *    threads at once unless its documentation says so; the engine serialises calls on itself with a lock.
 *    Freeing is the exception: when two threads free the same handle at once, exactly one frees it and the other
 *    call does nothing.
 *  - Files (checkpoints, data sets) are untrusted input: a damaged or hostile file is refused with a status and a
 *    message, never a crash, a hang (a FIFO or device is refused without blocking on it) or an allocation beyond
 *    what the file can honestly hold.
 *  - No C++ exception ever crosses this interface.
 */
#ifndef DPAR_H
#define DPAR_H

#include "dpar/common.h"       /* versions, statuses and errors, devices, element types */
#include "dpar/tensor.h"       /* tensors */
#include "dpar/dlpack.h"       /* tensors to and from other frameworks (DLPack) */
#include "dpar/model.h"        /* models and their layers */
#include "dpar/custom_layer.h" /* layers whose math is the caller's */
#include "dpar/optimizer.h"    /* optimizers */
#include "dpar/engine.h"       /* the DataParallel engine */
#include "dpar/comm.h"         /* collectives on the caller's buffers */
#include "dpar/reducer.h"      /* the gradient reducer */
#include "dpar/data.h"         /* datasets and the batch loader */

#endif /* DPAR_H */
