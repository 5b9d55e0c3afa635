//! `SegmentWatch`: the current descriptor of one segment, kept fresh by an
//! etcd watch.

use std::collections::VecDeque;

use etcd_client::{EventType, WatchOptions, WatchStream};
use transport_core::{ErrorKind, Result, SegmentDescriptor};

use crate::codec;
use crate::error::Ctx;
use crate::shared::{bounded, Shared};

/// Follows the descriptor of one segment.
///
/// Created by [`EtcdStore::watch`](crate::EtcdStore::watch): it reads the
/// descriptor and starts an etcd watch from the revision right after that
/// read, so no change between the two is missed. [`changed`](Self::changed)
/// yields every later change in order: `Some(descriptor)` when one was
/// published (a restarted peer shows a new generation), `None` when it was
/// removed or its lease expired.
///
/// # Behavior
/// - A descriptor with a smaller generation than the one last seen is
///   skipped (logged): a reader never goes back in generations. After a
///   removal any generation is accepted.
/// - `changed` waits as long as nothing changes; bound it with
///   `tokio::time::timeout` where needed.
/// - If etcd cancels the watch (its revision was compacted) or the stream
///   breaks, `changed` returns a transient error; create a new watch.
/// - Dropping the watch ends it; it owns no background task.
#[derive(Debug)]
pub struct SegmentWatch {
    name: String,
    key: String,
    endpoint: String,
    current: Option<SegmentDescriptor>,
    stream: WatchStream,
    pending: VecDeque<Option<SegmentDescriptor>>,
}

impl SegmentWatch {
    pub(crate) async fn start(shared: &Shared, name: &str) -> Result<Self> {
        let (current, revision) = shared.read_at(name, "watch").await?;
        let key = shared.config.key_for(name);
        let ctx = shared.ctx("watch", &key);
        let options = WatchOptions::new().with_start_revision(revision.saturating_add(1));
        let mut client = shared.client.clone();
        let stream = bounded(&ctx, shared.config.request_timeout, client.watch(key.as_bytes(), Some(options))).await?;
        Ok(Self {
            name: name.to_owned(),
            key,
            endpoint: shared.endpoint.clone(),
            current: current.map(|(desc, _)| desc),
            stream,
            pending: VecDeque::new(),
        })
    }

    /// The segment name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor as last seen: at creation, then after each `changed`.
    pub fn current(&self) -> Option<&SegmentDescriptor> {
        self.current.as_ref()
    }

    /// Waits for the next change and returns the new state (`None`: removed).
    pub async fn changed(&mut self) -> Result<Option<SegmentDescriptor>> {
        loop {
            if let Some(next) = self.pending.pop_front() {
                self.current.clone_from(&next);
                return Ok(next);
            }
            let ctx = Ctx { op: "watch", key: &self.key, endpoint: &self.endpoint };
            let resp = match self.stream.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return Err(ctx.error(ErrorKind::ConnectionReset, "the watch stream ended")),
                Err(e) => return Err(ctx.client(e)),
            };
            if resp.canceled() {
                return Err(ctx.error(
                    ErrorKind::ConnectionReset,
                    format_args!(
                        "etcd cancelled the watch (compact revision {}): {}",
                        resp.compact_revision(),
                        resp.cancel_reason()
                    ),
                ));
            }
            // The state the queued events lead to, for the generation check.
            let mut last = self.pending.back().cloned().unwrap_or_else(|| self.current.clone());
            for event in resp.events() {
                let next = match event.event_type() {
                    EventType::Delete => None,
                    EventType::Put => {
                        let Some(kv) = event.kv() else { continue };
                        let desc = codec::decode(kv.value(), &self.name, &ctx)?;
                        if let Some(seen) = &last {
                            if desc.generation < seen.generation {
                                tracing::warn!(
                                    key = self.key,
                                    seen = seen.generation,
                                    got = desc.generation,
                                    "skipping a descriptor with an older generation"
                                );
                                continue;
                            }
                        }
                        Some(desc)
                    }
                };
                last.clone_from(&next);
                self.pending.push_back(next);
            }
        }
    }
}
