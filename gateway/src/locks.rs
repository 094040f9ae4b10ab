//! The gateway's shared maps (sessions, caches, mailboxes, write queues) sit behind blocking
//! locks, held for a few map operations and never across an await.
//!
//! Not tokio's locks: an async lock is handed to its next waiter on release, and when that
//! waiter is a future its task has stopped polling (a session's pending work, once the session
//! ended) the lock stays with it for ever, and every session waits behind it. A blocking lock
//! is only ever held by code that is running. No holder panics (map operations only); a
//! poisoned lock is used as it stands.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A mutex for such maps (`std::sync::Mutex` is kept out of async code by clippy.toml unless
/// it is used this way).
#[allow(clippy::disallowed_types)]
pub(crate) type SyncMutex<T> = std::sync::Mutex<T>;

#[allow(clippy::disallowed_types)]
pub(crate) fn lock<T>(lock: &SyncMutex<T>) -> std::sync::MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
