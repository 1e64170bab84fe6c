//! Placeholder while the deploy manifests are written.
