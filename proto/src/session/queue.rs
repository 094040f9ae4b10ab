//! A FIFO that keeps one entry per key: a later value for a key already waiting merges into
//! the waiting entry and keeps its place in line.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// One entry per key, popped in the order keys were first enqueued.
///
/// Keeping the first position (rather than moving a re-enqueued key to the back) bounds how long
/// any key can wait: a work that changes constantly is still sent once its turn comes, instead
/// of being pushed back forever by its own updates.
#[derive(Debug)]
pub(crate) struct CoalescingQueue<K, V> {
    /// Key → (position, value). The position indexes `order`.
    entries: HashMap<K, (u64, V)>,
    /// Position → key, so popping the oldest key and removing any key are both O(log n).
    order: BTreeMap<u64, K>,
    /// The position the next new key gets; only grows.
    next: u64,
}

impl<K: Hash + Eq + Clone, V> Default for CoalescingQueue<K, V> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next: 0,
        }
    }
}

impl<K: Hash + Eq + Clone, V> CoalescingQueue<K, V> {
    /// Number of distinct keys waiting.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(_, v)| v)
    }

    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Replaces the value of a waiting key in place (keeping its position), or appends a new key.
    pub(crate) fn put(&mut self, key: K, value: V) {
        if let Some((_, v)) = self.entries.get_mut(&key) {
            *v = value;
            return;
        }
        let pos = self.next;
        self.next += 1;
        self.order.insert(pos, key.clone());
        self.entries.insert(key, (pos, value));
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let (pos, v) = self.entries.remove(key)?;
        self.order.remove(&pos);
        Some(v)
    }

    /// The oldest waiting key and its latest value.
    pub(crate) fn pop(&mut self) -> Option<(K, V)> {
        let (_, key) = self.order.pop_first()?;
        let (_, v) = self
            .entries
            .remove(&key)
            .expect("every ordered key has an entry");
        Some((key, v))
    }

    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut CoalescingQueue<&'static str, u32>) -> Vec<(&'static str, u32)> {
        std::iter::from_fn(|| q.pop()).collect()
    }

    #[test]
    fn keeps_first_position_and_latest_value() {
        let mut q = CoalescingQueue::default();
        q.put("a", 1);
        q.put("b", 1);
        q.put("a", 2);
        q.put("c", 1);
        q.put("a", 3);
        assert_eq!(q.len(), 3);
        assert_eq!(drain(&mut q), vec![("a", 3), ("b", 1), ("c", 1)]);
    }

    #[test]
    fn removed_key_loses_its_place() {
        let mut q = CoalescingQueue::default();
        q.put("a", 1);
        q.put("b", 1);
        assert_eq!(q.remove(&"a"), Some(1));
        q.put("a", 2);
        assert_eq!(drain(&mut q), vec![("b", 1), ("a", 2)]);
        assert_eq!(q.len(), 0);
    }
}
