//! The error of a map write or delete, shared by the typed maps (`maps`) and the writer
//! threads that hold a cold start's writes (`held`).
use aya::maps::MapError;

/// A failed map write or delete.
#[derive(Debug, thiserror::Error)]
pub enum MapOpError {
    #[error("map {map} is full")]
    Full { map: &'static str },
    #[error("map {map}: {source}")]
    Other {
        map: &'static str,
        #[source]
        source: MapError,
    },
}

impl MapOpError {
    pub(crate) fn from_aya(map: &'static str, source: MapError) -> Self {
        if let MapError::SyscallError(e) = &source
            && e.io_error.raw_os_error() == Some(libc::E2BIG)
        {
            return MapOpError::Full { map };
        }
        MapOpError::Other { map, source }
    }
}
