//! Unsigned 64-bit integers from Python, read the fast way.
//!
//! CPython (3.11) reads a C `long` digit by digit but a `long long`
//! through its generic byte conversion, several times slower; addresses
//! are large integers, and a batch carries thousands of them. On this
//! platform a `long` is 64 bits, so an integer is read as `i64` first and
//! only one that does not fit (2^63 and above, negatives, objects with
//! `__index__` beyond `i64`) as `u64`, which accepts and refuses exactly
//! what a plain `u64` argument does, with the same error.

use std::ops::Deref;

use pyo3::prelude::*;

/// A `u64` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Word(pub(crate) u64);

impl<'py> FromPyObject<'py> for Word {
    fn extract_bound(v: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(x) = v.extract::<i64>() {
            if let Ok(u) = u64::try_from(x) {
                return Ok(Word(u));
            }
        }
        v.extract::<u64>().map(Word)
    }
}

/// A list (any sequence but `str`) of `u64`s, as `Vec<u64>` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Words(pub(crate) Vec<u64>);

impl<'py> FromPyObject<'py> for Words {
    fn extract_bound(v: &Bound<'py, PyAny>) -> PyResult<Self> {
        let words: Vec<Word> = v.extract()?;
        Ok(Words(words.into_iter().map(|w| w.0).collect()))
    }
}

impl Deref for Words {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        &self.0
    }
}
