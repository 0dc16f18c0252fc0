//! The `events` tree: a run's log, stored as packs of consecutive events (ADR 45).
//!
//! A value holds the events of one run from the seq in its key on: one event (its
//! MessagePack map, as every store before packs wrote), or several consecutive ones (a
//! MessagePack array of those maps). A flush of a branch's turn (a model response, its tool
//! calls, the files they change, their results) is one value, so one sled insert, not one
//! per event: sled copies the leaf it inserts into, and the per-event inserts were the
//! coordinator's largest share of a turn's CPU on a cluster (docs/BENCHMARKS.md). Seq 0 (a
//! run's lineage event, which listings read for every run) is always a value of its own.
//!
//! Values never overlap: a seq is written once (the replica drops duplicates, and the fork
//! actor applies every event it writes, so a redelivery never packs written events
//! otherwise), and deleting events rewrites the packs that hold them.
//!
//! Readers go through [`RunStore`]'s methods here; nothing else reads the tree.

use super::{decode, event_key, RunStore};
use crate::error::CoordinatorError;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use std::collections::BTreeMap;

/// Event writes gathered before one sled batch: encoded events by (run, seq), packed into
/// values of consecutive seqs when applied.
#[derive(Default)]
pub(crate) struct EventWrites {
    events: Vec<(RunId, u64, Vec<u8>)>,
}

impl EventWrites {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            events: Vec::with_capacity(n),
        }
    }

    /// Add one encoded event (`super::encode("event", ...)`). A (run, seq) added twice is
    /// the caller's error; the first is kept.
    pub fn push(&mut self, run: RunId, seq: u64, encoded: Vec<u8>) {
        self.events.push((run, seq, encoded));
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Add to `batch` a value per stretch of consecutive seqs of one run, seq 0 always a
    /// value of its own (a run's lineage event, read alone for every listed run). (A sled
    /// batch is a map: an insert replaces a removal of the same key made before it.)
    fn add_to(mut self, batch: &mut sled::Batch) {
        // Stable: of a (run, seq) added twice, the first stays first.
        self.events.sort_by_key(|(run, seq, _)| (*run, *seq));
        self.events.dedup_by_key(|(run, seq, _)| (*run, *seq));
        let mut events = self.events.into_iter().peekable();
        while let Some((run, first, encoded)) = events.next() {
            let mut pack = vec![encoded];
            while let Some((_, _, next)) = events
                .next_if(|(r, s, _)| first > 0 && *r == run && *s == first + pack.len() as u64)
            {
                pack.push(next);
            }
            batch.insert(&event_key(run, first), pack_value(pack));
        }
    }
}

/// The stored value of consecutive encoded events: the event itself when alone, else a
/// MessagePack array of them.
fn pack_value(mut pack: Vec<Vec<u8>>) -> Vec<u8> {
    if pack.len() == 1 {
        return pack.pop().unwrap_or_default();
    }
    let bytes: usize = pack.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(bytes + 5);
    // Writing into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut out, u32::try_from(pack.len()).unwrap_or(u32::MAX));
    for e in pack {
        out.extend_from_slice(&e);
    }
    out
}

/// Whether a stored value is a pack (an array) rather than one event (a map).
fn is_pack(value: &[u8]) -> bool {
    matches!(
        value.first().map(|b| rmp::Marker::from_u8(*b)),
        Some(rmp::Marker::FixArray(_) | rmp::Marker::Array16 | rmp::Marker::Array32)
    )
}

/// How many events a stored value holds.
fn count(value: &[u8]) -> usize {
    if !is_pack(value) {
        return 1;
    }
    let mut rd = value;
    rmp::decode::read_array_len(&mut rd).map_or(1, |n| n as usize)
}

/// The events of a stored value, the first at `seq`.
fn unpack(seq: u64, value: &[u8]) -> Result<Vec<(u64, Event)>, CoordinatorError> {
    if !is_pack(value) {
        return Ok(vec![(seq, decode("event", value)?)]);
    }
    let events: Vec<Event> = decode("events", value)?;
    Ok((seq..).zip(events).collect())
}

/// The seq of an `events` key.
fn key_seq(key: &[u8]) -> Result<u64, CoordinatorError> {
    key.get(16..24)
        .and_then(|s| <[u8; 8]>::try_from(s).ok())
        .map(u64::from_be_bytes)
        .ok_or_else(|| CoordinatorError::codec("event key", "not 24 bytes"))
}

impl RunStore {
    /// Write events gathered in `writes`, packed, in one batch (not flushed).
    pub(crate) fn write_events(&self, writes: EventWrites) -> Result<(), CoordinatorError> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        writes.add_to(&mut batch);
        self.inner.events.apply_batch(batch)?;
        Ok(())
    }

    /// Write a run of events atomically (not flushed).
    pub(crate) fn put_events<'a>(
        &self,
        events: impl IntoIterator<Item = (RunId, u64, &'a Event)>,
    ) -> Result<(), CoordinatorError> {
        let mut writes = EventWrites::default();
        for (run, seq, event) in events {
            writes.push(run, seq, super::encode("event", event)?);
        }
        self.write_events(writes)
    }

    /// The stored value holding `seq` of `run`: its first seq and its bytes.
    fn value_holding(
        &self,
        run: RunId,
        seq: u64,
    ) -> Result<Option<(u64, sled::IVec)>, CoordinatorError> {
        let Some((k, v)) = self
            .inner
            .events
            .range(event_key(run, 0)..=event_key(run, seq))
            .next_back()
            .transpose()?
        else {
            return Ok(None);
        };
        let first = key_seq(&k)?;
        Ok((first + count(&v) as u64 > seq).then_some((first, v)))
    }

    /// One event of a run's log.
    pub(crate) fn event(&self, run: RunId, seq: u64) -> Result<Option<Event>, CoordinatorError> {
        let Some((first, v)) = self.value_holding(run, seq)? else {
            return Ok(None);
        };
        Ok(unpack(first, &v)?
            .into_iter()
            .find_map(|(s, e)| (s == seq).then_some(e)))
    }

    /// Delete stored events of a run (held events of a fenced-off attempt): the packs that
    /// hold them are written again without them, in one batch.
    pub(crate) fn delete_events(&self, run: RunId, seqs: &[u64]) -> Result<(), CoordinatorError> {
        let mut holding: BTreeMap<u64, sled::IVec> = BTreeMap::new();
        for &seq in seqs {
            if let Some((first, v)) = self.value_holding(run, seq)? {
                holding.insert(first, v);
            }
        }
        let mut batch = sled::Batch::default();
        let mut kept = EventWrites::default();
        for (first, v) in holding {
            batch.remove(&event_key(run, first));
            if count(&v) == 1 {
                continue;
            }
            for (seq, event) in unpack(first, &v)? {
                if !seqs.contains(&seq) {
                    kept.push(run, seq, super::encode("event", &event)?);
                }
            }
        }
        // After the removals: a kept pack may start at a removed key.
        kept.add_to(&mut batch);
        self.inner.events.apply_batch(batch)?;
        Ok(())
    }

    /// Every stored event of a run, in seq order, gaps included (events held until an
    /// earlier one arrives are stored too).
    pub(crate) fn stored_events(&self, run: RunId) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        let mut out = Vec::new();
        for kv in self.inner.events.scan_prefix(run.as_bytes()) {
            let (k, v) = kv?;
            out.extend(unpack(key_seq(&k)?, &v)?);
        }
        Ok(out)
    }

    /// A run's log: its events from seq 0 up to the first gap.
    pub fn run_log(&self, run: RunId) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        let mut events = self.stored_events(run)?;
        let contiguous = events
            .iter()
            .enumerate()
            .take_while(|(i, (seq, _))| *i as u64 == *seq)
            .count();
        events.truncate(contiguous);
        Ok(events)
    }

    /// Remove every stored event of `run`; how many there were.
    pub(crate) fn remove_events(&self, run: RunId) -> Result<usize, CoordinatorError> {
        let mut removed = 0;
        for kv in self.inner.events.scan_prefix(run.as_bytes()) {
            let (k, v) = kv?;
            removed += count(&v);
            self.inner.events.remove(k)?;
        }
        Ok(removed)
    }

    /// Events stored of `run`.
    pub(crate) fn run_event_count(&self, run: RunId) -> Result<usize, CoordinatorError> {
        let mut n = 0;
        for v in self.inner.events.scan_prefix(run.as_bytes()).values() {
            n += count(&v?);
        }
        Ok(n)
    }

    /// Events stored, over every run.
    pub(crate) fn event_count(&self) -> Result<usize, CoordinatorError> {
        let mut n = 0;
        for v in self.inner.events.iter().values() {
            n += count(&v?);
        }
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn ev(t: &str) -> Event {
        Event::Steer { text: t.into() }
    }

    fn texts(events: &[(u64, Event)]) -> Vec<(u64, String)> {
        events
            .iter()
            .map(|(s, e)| match e {
                Event::Steer { text } => (*s, text.clone()),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    fn write(store: &RunStore, run: RunId, events: &[(u64, &str)]) {
        let mut w = EventWrites::default();
        for (seq, t) in events {
            w.push(run, *seq, super::super::encode("event", &ev(t)).unwrap());
        }
        store.write_events(w).unwrap();
    }

    #[test]
    fn a_flush_of_consecutive_events_is_one_value_and_reads_back_event_by_event() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let (run, other) = (RunId::new(), RunId::new());
        // Out of order, two runs, one gap (4): seq 0 alone, 1..=3, 5..=6, the other's 0.
        write(
            &store,
            run,
            &[(2, "c"), (0, "a"), (1, "b"), (3, "d"), (5, "f"), (6, "g")],
        );
        write(&store, other, &[(0, "x")]);
        assert_eq!(store.inner.events.len(), 4);
        assert_eq!(store.event_count().unwrap(), 7);
        assert_eq!(
            texts(&store.stored_events(run).unwrap()),
            [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (5, "f"), (6, "g")]
                .map(|(s, t)| (s, t.to_string()))
        );
        assert_eq!(
            store.run_log(run).unwrap().len(),
            4,
            "the log stops at the gap"
        );
        for (seq, t) in [(0, "a"), (2, "c"), (3, "d"), (6, "g")] {
            assert_eq!(store.event(run, seq).unwrap(), Some(ev(t)), "seq {seq}");
        }
        assert_eq!(store.event(run, 4).unwrap(), None);
        assert_eq!(store.event(run, 7).unwrap(), None);
        assert_eq!(store.event(other, 0).unwrap(), Some(ev("x")));
        assert_eq!(store.event(other, 1).unwrap(), None);
        // The gap filled later: a value of its own, the log whole.
        write(&store, run, &[(4, "e")]);
        assert_eq!(store.run_log(run).unwrap().len(), 7);
    }

    #[test]
    fn events_stored_one_per_value_by_an_earlier_build_read_beside_packs() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let run = RunId::new();
        for (seq, t) in [(0, "a"), (1, "b")] {
            let v = super::super::encode("event", &ev(t)).unwrap();
            store.inner.events.insert(event_key(run, seq), v).unwrap();
        }
        write(&store, run, &[(2, "c"), (3, "d")]);
        assert_eq!(
            texts(&store.run_log(run).unwrap()),
            [(0, "a"), (1, "b"), (2, "c"), (3, "d")].map(|(s, t)| (s, t.to_string()))
        );
        assert_eq!(store.event(run, 1).unwrap(), Some(ev("b")));
        assert_eq!(store.event(run, 3).unwrap(), Some(ev("d")));
    }

    #[test]
    fn deleting_events_inside_a_pack_keeps_the_rest_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path()).unwrap();
        let run = RunId::new();
        write(&store, run, &[(0, "a"), (1, "b")]);
        // Held events of an attempt later fenced off: 5..=9, of which 5, 7 and 9 go.
        write(
            &store,
            run,
            &[(5, "f"), (6, "g"), (7, "h"), (8, "i"), (9, "j")],
        );
        store.delete_events(run, &[5, 7, 9, 12]).unwrap();
        assert_eq!(
            texts(&store.stored_events(run).unwrap()),
            [(0, "a"), (1, "b"), (6, "g"), (8, "i")].map(|(s, t)| (s, t.to_string()))
        );
        assert_eq!(store.event(run, 7).unwrap(), None);
        assert_eq!(store.event(run, 8).unwrap(), Some(ev("i")));
        // The first event of a pack, and a single value.
        store.delete_events(run, &[0, 6]).unwrap();
        assert_eq!(
            texts(&store.stored_events(run).unwrap()),
            [(1, "b"), (8, "i")].map(|(s, t)| (s, t.to_string()))
        );
        assert_eq!(store.remove_events(run).unwrap(), 2);
        assert_eq!(store.event_count().unwrap(), 0);
    }
}
