//! Exponential backoff with jitter.

use std::time::Duration;

use rand::Rng;

use super::config::RetryConfig;

/// The pause before attempt number `attempt + 1`, where `attempt >= 1` is
/// the attempt that just failed: `initial * multiplier^(attempt-1)`, capped
/// at `max_backoff`, then spread by ±`jitter` using `rng`.
pub fn backoff(cfg: &RetryConfig, attempt: u32, rng: &mut impl Rng) -> Duration {
    let exp = cfg.multiplier.powi(attempt.saturating_sub(1).min(64) as i32);
    let base = cfg.initial_backoff.as_secs_f64() * exp;
    let capped = base.min(cfg.max_backoff.as_secs_f64());
    let spread = if cfg.jitter > 0.0 { rng.gen_range(-cfg.jitter..=cfg.jitter) } else { 0.0 };
    Duration::from_secs_f64((capped * (1.0 + spread)).max(0.0))
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn grows_caps_and_jitters_within_bounds() {
        let cfg = RetryConfig {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
            multiplier: 2.0,
            jitter: 0.5,
        };
        let mut rng = SmallRng::seed_from_u64(7);
        let mut seen = std::collections::HashSet::new();
        for attempt in 1..=8 {
            let nominal = (10.0 * 2f64.powi(attempt - 1)).min(100.0);
            for _ in 0..50 {
                let d = backoff(&cfg, attempt as u32, &mut rng).as_secs_f64() * 1000.0;
                assert!(d >= nominal * 0.5 - 1e-9 && d <= nominal * 1.5 + 1e-9, "attempt {attempt}: {d} ms");
                seen.insert((d * 1000.0) as u64);
            }
        }
        assert!(seen.len() > 100, "jitter spreads the pauses");
    }

    #[test]
    fn no_jitter_is_exact() {
        let cfg = RetryConfig { jitter: 0.0, ..RetryConfig::default() };
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(backoff(&cfg, 1, &mut rng), cfg.initial_backoff);
        assert_eq!(backoff(&cfg, 2, &mut rng), cfg.initial_backoff * 2);
        assert_eq!(backoff(&cfg, 60, &mut rng), cfg.max_backoff);
    }
}
