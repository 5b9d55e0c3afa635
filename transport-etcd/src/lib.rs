//! Segment descriptors in etcd, for clusters: a [`MetadataStore`] whose
//! entries vanish with the peer that published them.
//!
//! # Key layout
//!
//! The descriptor of segment `name` is stored as JSON (the serde form of
//! [`SegmentDescriptor`]) under the key `<prefix><name>`, with the prefix
//! from [`EtcdConfig::prefix`] (default `/kvmove/segments/`, so a peer at
//! `10.0.0.1:7000` lives at `/kvmove/segments/10.0.0.1:7000`). Anything
//! under that key that is not a descriptor of `name` is reported as a
//! `Protocol` error, never silently used.
//!
//! # Leases
//!
//! Each descriptor a store publishes is attached to an etcd lease of
//! [`EtcdConfig::lease_ttl_secs`] (one lease per segment name), and one
//! background task per store renews all of them every third of the TTL. A
//! peer that dies or is cut off stops renewing, and etcd deletes its
//! descriptors when the lease runs out: the cluster forgets dead peers by
//! itself. [`EtcdStore::close`] stops the task and revokes the leases (the
//! descriptors go at once); dropping the store stops the task without
//! revoking (they go at expiry, as for a crash). The task is counted
//! ([`EtcdStore::background_tasks`]) and never outlives the store. If a
//! lease expires while the store lives (a long pause), the task publishes
//! the descriptor again on a new lease.
//!
//! # Generations
//!
//! A peer bumps [`SegmentDescriptor::generation`] on every start. `put`
//! never lets a smaller generation overwrite a larger one: it reads the
//! key, checks the generation and writes in one etcd transaction guarded by
//! the key's mod revision (or its absence), retrying when another writer
//! came in between. A stale writer gets a permanent `InvalidRequest`.
//! Once a descriptor is gone (removed, lease expired) any generation may be
//! published, so generations should grow across restarts (a start time or
//! a counter kept on disk), not restart from zero.
//!
//! # Watch
//!
//! [`EtcdStore::watch`] returns a [`SegmentWatch`] that holds the current
//! descriptor and yields every change after it, read from an etcd watch
//! that starts at the revision of the initial read, so nothing in between
//! is lost. A peer that restarted shows up as a new generation; a peer that
//! left or died shows up as `None`. Transports use it to drop endpoints
//! built on a stale descriptor instead of using them.
//!
//! # Errors
//!
//! Every request is bounded by [`EtcdConfig::request_timeout`], and
//! connecting by [`EtcdConfig::connect_timeout`]; nothing waits forever.
//! Failures map to [`transport_core::ErrorKind`]s: unreachable etcd is
//! `ConnectionRefused` (transient), no answer in time is `Timeout`
//! (transient), bytes that are not a descriptor are `Protocol`, a stale
//! generation is `InvalidRequest` (permanent). Each error names the
//! operation, the key and the endpoints in its context.
//!
//! # Build
//!
//! The etcd client compiles etcd's protobuf definitions at build time and
//! needs `protoc` (Debian: `protobuf-compiler`); `install-etcd.sh` installs
//! it with the etcd server the tests run against.

mod codec;
mod config;
mod error;
mod keepalive;
mod shared;
mod store;
mod watch;

pub use config::EtcdConfig;
pub use store::EtcdStore;
pub use transport_core::MetadataStore;
pub use watch::SegmentWatch;

#[cfg(doc)]
use transport_core::SegmentDescriptor;
