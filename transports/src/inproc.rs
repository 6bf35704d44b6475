//! The in-process transport: readers share an immutable weight set; publishing is a pointer
//! swap whatever the size.
//!
//! It is implemented in the core ([`refit_runtime::inproc`], where it drives the scheme's
//! unit tests) and re-exported here beside the other transports; see there for the details.

pub use refit_runtime::inproc::{InProc, InProcReceiver, InProcSender};
