//! Serde for `Duration` as integer milliseconds, the convention of every
//! config in the project (`*_ms` keys): `#[serde(with = "transport_core::serde_ms")]`,
//! or `transport_core::serde_ms::option` for `Option<Duration>`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Writes whole milliseconds (saturating).
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_millis().min(u64::MAX as u128) as u64)
}

/// Reads whole milliseconds.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    Ok(Duration::from_millis(u64::deserialize(d)?))
}

/// The same for `Option<Duration>` (absent or null is `None`).
pub mod option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes whole milliseconds or none.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&(d.as_millis().min(u64::MAX as u128) as u64)),
            None => s.serialize_none(),
        }
    }

    /// Reads whole milliseconds or none.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}
