//! Small serde helpers shared by the OCM types.
//!
//! OCM's Go types emit `null` for a nil slice or map whose json tag lacks `omitempty`
//! (`status.conditions`, `status.decisions`, ...). YAML read back from an OCM hub therefore may
//! carry `conditions: null`; these helpers read that as empty instead of failing.

use serde::{Deserialize, Deserializer};

/// Deserializes `null` as `T::default()` (an empty list or map), anything else as `T`.
pub(crate) fn null_as_default<'de, D, T>(de: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(de)?.unwrap_or_default())
}

/// `skip_serializing_if` for fields whose empty value OCM leaves out.
pub(crate) fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}
