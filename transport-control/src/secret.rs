//! The shared secret as a value: configs are printed (`{:?}` in logs, in
//! error reports, by `kvmove config`), and a secret must never be.

use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

/// A shared secret (`TcpConfig::secret`, `RdmaConfig::secret`). Reads as
/// the string it holds (`Deref<Target = str>`) and is written to and read
/// from a config file as that string; its `Debug` shows only its length.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Deref for Secret {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes, not shown>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_secret_and_serde_keeps_the_string() {
        let s = Secret::from("hunter2-very-secret");
        let shown = format!("{s:?} {:?}", Some(s.clone()));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("19 bytes"), "{shown}");
        assert_eq!(&*s, "hunter2-very-secret");
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, "\"hunter2-very-secret\"");
        assert_eq!(serde_json::from_str::<Secret>(&json).unwrap(), s);
    }
}
