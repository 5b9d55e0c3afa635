//! KV-cache-shaped workloads: model presets, pages, and the requests that
//! move them.
//!
//! A request's KV cache is `layers x parts x pages`, where `parts` is 2 for
//! attention with separate K and V (Llama) and 1 for MLA's single latent
//! (DeepSeek-V3), and a page holds `page_size` tokens of one part of one
//! layer. Both sides keep the cache in a pool of page slots, as paged
//! attention does:
//!
//! - **contiguous**: page `p` of a layer's part sits right after page
//!   `p - 1` on both sides, so the pages of one (layer, part) merge into one
//!   large request (split at [`MAX_RUN`]).
//! - **scattered**: every page sits in a random slot (a seeded shuffle) on
//!   each side, so each page is its own request to a random destination.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::settings::{Fragmentation, WorkloadConfig};

/// Largest request a contiguous run is merged into.
pub const MAX_RUN: u64 = 64 << 20;

/// Most pages (layers x parts x pages per part) one plan may hold.
pub const MAX_UNITS: u64 = 1 << 24;

/// A model's KV-cache geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Model {
    pub name: &'static str,
    pub layers: u32,
    /// 2 for separate K and V, 1 for MLA's joint latent.
    pub parts: u32,
    /// Bytes per token per layer, all parts together.
    pub bytes_per_token_layer: u64,
}

/// The presets `--model` accepts.
pub const MODELS: [Model; 3] = [
    // 8 KV heads x 128 dims x 2 bytes = 2 KiB per K (and per V) per token per layer.
    Model { name: "llama3-8b", layers: 32, parts: 2, bytes_per_token_layer: 4096 },
    Model { name: "llama3-70b", layers: 80, parts: 2, bytes_per_token_layer: 4096 },
    // MLA: (512 latent + 64 rope) x 2 bytes = 1,152 bytes per token per layer.
    Model { name: "deepseek-v3", layers: 61, parts: 1, bytes_per_token_layer: 1152 },
];

/// The model named `name`.
pub fn model(name: &str) -> Option<Model> {
    MODELS.iter().copied().find(|m| m.name == name)
}

/// The names of the presets, for messages.
pub fn model_names() -> String {
    MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// One transfer of the plan, between the initiator's local buffer and the
/// target's buffer (offsets from the start of each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Req {
    pub local_off: u64,
    pub remote_off: u64,
    pub len: u64,
}

/// Sizes derived from the options, checked.
struct Geometry {
    m: Model,
    layers: u32,
    part_bytes: u64,
    page_bytes: u64,
    pages: u64,
    units: u64,
    buffer_len: u64,
}

impl Geometry {
    fn of(w: &WorkloadConfig) -> Result<Geometry, String> {
        let base = model(&w.model).ok_or_else(|| format!("unknown model '{}'; known: {}", w.model, model_names()))?;
        let mut m = base;
        if let Some(b) = w.bytes_per_token {
            m.bytes_per_token_layer = b;
        }
        let layers = w.layers.unwrap_or(m.layers);
        if layers == 0 {
            return Err("workload.layers must be at least 1".into());
        }
        if w.tokens == 0 {
            return Err("workload.tokens must be at least 1".into());
        }
        if w.page_size == 0 {
            return Err("workload.page_size must be at least 1 token".into());
        }
        if m.bytes_per_token_layer == 0 || m.bytes_per_token_layer % u64::from(m.parts) != 0 {
            return Err(format!("workload.bytes_per_token must be a positive multiple of {}", m.parts));
        }
        let part_bytes = m.bytes_per_token_layer / u64::from(m.parts);
        let page_bytes = w.page_size.checked_mul(part_bytes).ok_or("workload.page_size is too large")?;
        let pages = w.tokens.div_ceil(w.page_size);
        let units = u64::from(layers)
            .checked_mul(u64::from(m.parts))
            .and_then(|u| u.checked_mul(pages))
            .filter(|&u| u <= MAX_UNITS)
            .ok_or_else(|| {
                format!("the workload has more than {MAX_UNITS} pages; raise --page-size or lower --tokens or --layers")
            })?;
        let buffer_len = units
            .checked_mul(page_bytes)
            .filter(|&b| b <= (1 << 40))
            .ok_or_else(|| "the workload is larger than 1 TiB; lower --tokens or --layers".to_owned())?;
        Ok(Geometry { m, layers, part_bytes, page_bytes, pages, units, buffer_len })
    }
}

/// The whole workload of one pass: requests grouped by layer.
#[derive(Debug, Clone)]
pub struct Plan {
    pub model: Model,
    pub layers: u32,
    pub page_bytes: u64,
    /// Requests of each layer (one batch per layer).
    pub by_layer: Vec<Vec<Req>>,
    /// Bytes of the initiator's buffer (and of the target's).
    pub buffer_len: u64,
    pub total_bytes: u64,
    pub total_requests: usize,
}

impl Plan {
    /// Bytes of each side's buffer for this workload, without building
    /// the plan (to check memory first).
    pub fn buffer_len(w: &WorkloadConfig) -> Result<u64, String> {
        Geometry::of(w).map(|g| g.buffer_len)
    }

    /// Builds the plan; errors are one line that names the option.
    pub fn new(w: &WorkloadConfig) -> Result<Plan, String> {
        let Geometry { m, layers, part_bytes, page_bytes, pages, units, buffer_len } = Geometry::of(w)?;
        // Length of page `p` (the last page may be partial).
        let page_len = |p: u64| {
            let first = p * w.page_size;
            (w.tokens - first).min(w.page_size) * part_bytes
        };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(w.seed);
        let slots = |rng: &mut rand::rngs::SmallRng| -> Vec<u64> {
            let mut v: Vec<u64> = (0..units).collect();
            if w.fragmentation == Fragmentation::Scattered {
                v.shuffle(rng);
            }
            v
        };
        let src_slot = slots(&mut rng);
        let dst_slot = slots(&mut rng);
        let mut by_layer = Vec::with_capacity(layers as usize);
        let mut total_bytes = 0u64;
        let mut total_requests = 0usize;
        for l in 0..u64::from(layers) {
            let mut reqs: Vec<Req> = Vec::new();
            for part in 0..u64::from(m.parts) {
                for p in 0..pages {
                    let u = ((l * u64::from(m.parts) + part) * pages + p) as usize;
                    let r = Req {
                        local_off: src_slot[u] * page_bytes,
                        remote_off: dst_slot[u] * page_bytes,
                        len: page_len(p),
                    };
                    total_bytes += r.len;
                    // Merge with the previous request when both sides continue it.
                    if let Some(last) = reqs.last_mut() {
                        if w.fragmentation == Fragmentation::Contiguous
                            && p > 0
                            && last.local_off + last.len == r.local_off
                            && last.remote_off + last.len == r.remote_off
                            && last.len + r.len <= MAX_RUN
                        {
                            last.len += r.len;
                            continue;
                        }
                    }
                    reqs.push(r);
                }
            }
            total_requests += reqs.len();
            by_layer.push(reqs);
        }
        Ok(Plan { model: m, layers, page_bytes, by_layer, buffer_len, total_bytes, total_requests })
    }

    /// Every request, layer by layer.
    pub fn requests(&self) -> impl Iterator<Item = &Req> {
        self.by_layer.iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn w(model: &str, tokens: u64, page: u64, frag: Fragmentation) -> WorkloadConfig {
        WorkloadConfig { model: model.into(), tokens, page_size: page, fragmentation: frag, ..Default::default() }
    }

    #[test]
    fn llama3_8b_4k_tokens_is_512_mib() {
        let p = Plan::new(&w("llama3-8b", 4096, 16, Fragmentation::Scattered)).unwrap();
        assert_eq!(p.total_bytes, 512 << 20);
        assert_eq!(p.page_bytes, 16 * 2048);
        assert_eq!(p.total_requests, 32 * 2 * 256);
        assert_eq!(p.buffer_len, 512 << 20);
    }

    #[test]
    fn contiguous_merges_runs_per_layer_part() {
        let p = Plan::new(&w("llama3-8b", 1000, 16, Fragmentation::Contiguous)).unwrap();
        assert_eq!(p.total_requests, 32 * 2);
        assert_eq!(p.by_layer[0][0].len, 1000 * 2048);
        assert_eq!(p.total_bytes, 1000 * 4096 * 32);
    }

    #[test]
    fn deepseek_mla_has_one_part() {
        let p = Plan::new(&w("deepseek-v3", 64, 64, Fragmentation::Scattered)).unwrap();
        assert_eq!(p.total_requests, 61);
        assert_eq!(p.page_bytes, 64 * 1152);
    }

    #[test]
    fn scattered_destinations_are_distinct_and_in_bounds() {
        let p = Plan::new(&w("llama3-8b", 256, 16, Fragmentation::Scattered)).unwrap();
        let mut offs: Vec<u64> = p.requests().map(|r| r.remote_off).collect();
        offs.sort_unstable();
        offs.dedup();
        assert_eq!(offs.len(), p.total_requests);
        assert_eq!(p.total_requests, 16 * 2 * 32, "one request per page, never merged");
        assert!(p.requests().all(|r| r.remote_off + r.len <= p.buffer_len && r.local_off + r.len <= p.buffer_len));
    }

    #[test]
    fn bad_options_are_named() {
        assert!(Plan::new(&w("gpt-5", 16, 16, Fragmentation::Scattered)).unwrap_err().contains("unknown model"));
        assert!(Plan::new(&w("llama3-8b", 0, 16, Fragmentation::Scattered)).unwrap_err().contains("tokens"));
    }
}
