//! KV-cache events: which blocks an engine rank stored or evicted, once the
//! engines' `KVEventBatch` wire format is decoded (`wire::kv_events`).

crate::names! {
    /// Where a block lives. Only `Gpu` blocks count toward prefix matches; the
    /// others are indexed apart (docs/PROTOCOL.md §11a).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Medium {
        Gpu => "GPU",
        /// vLLM `CPU`, SGLang `CPU_PINNED`.
        Cpu => "CPU",
        /// vLLM `STORAGE`, SGLang `DISK`.
        Disk => "DISK",
        /// SGLang `EXTERNAL` (a shared or remote pool).
        External => "EXTERNAL",
    }
}

impl Medium {
    /// The engine's name, `None` (nil) meaning GPU; `None` back for a name
    /// no engine uses.
    pub fn parse(name: Option<&str>) -> Option<Medium> {
        Some(match name {
            None | Some("GPU") => Medium::Gpu,
            Some("CPU" | "CPU_PINNED") => Medium::Cpu,
            Some("STORAGE" | "DISK") => Medium::Disk,
            Some("EXTERNAL") => Medium::External,
            Some(_) => return None,
        })
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// `BlockStored`: consecutive blocks of one prefix, the first continuing
/// `parent` (the engine's hash) or starting a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The engine's hash of each block (its last 8 bytes when longer).
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    /// Every token of the listed blocks, `hashes.len() * block_size`.
    pub tokens: Vec<u32>,
    pub block_size: u32,
    pub medium: Medium,
    pub lora: Option<String>,
    pub salt: Option<String>,
    /// The first block whose cache identity the event's tokens, LoRA name
    /// and salt do not carry (multimodal inputs, prompt embeddings,
    /// lookahead tokens), with why: it and every block after it, in this
    /// event and continuing it, are held but never matched.
    pub unmatchable: Option<(usize, &'static str)>,
    /// The KV cache group (vLLM's `group_idx`; 0 when absent): a hybrid
    /// model publishes each block once per group, with the same hashes.
    pub group: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    Stored(Stored),
    Removed {
        hashes: Vec<u64>,
        medium: Medium,
        /// The KV cache group the hashes are removed from.
        group: u32,
    },
    Cleared,
    /// A well-formed event the index cannot key exactly (why): counted,
    /// the rest of its batch applies.
    Unindexable(&'static str),
}

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBatch {
    /// The batch's own `dp_rank`; nil when the engine left it out.
    pub rank: Option<u32>,
    pub events: Vec<KvEvent>,
}

impl KvBatch {
    /// About how many bytes of memory the decoded batch holds: its hashes,
    /// tokens and strings, plus a fixed overhead per event.
    pub fn held_bytes(&self) -> usize {
        const PER_EVENT: usize = std::mem::size_of::<KvEvent>() + 32;
        let event = |e: &KvEvent| match e {
            KvEvent::Stored(s) => {
                s.hashes.len() * 8
                    + s.tokens.len() * 4
                    + s.lora.as_ref().map_or(0, String::len)
                    + s.salt.as_ref().map_or(0, String::len)
            }
            KvEvent::Removed { hashes, .. } => hashes.len() * 8,
            _ => 0,
        };
        self.events.iter().map(|e| PER_EVENT + event(e)).sum::<usize>() + std::mem::size_of::<KvBatch>()
    }
}

/// One message of a KV publisher or of its replay socket, before the
/// payload is applied: `stream` is the publisher's position in
/// `kv_events.connect` (after expansion).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvMessage {
    pub stream: u16,
    pub from_replay: bool,
    pub body: KvBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvBody {
    /// A numbered batch; the payload decoded, or why not (the `seq` still
    /// counts: a batch that does not decode is not a gap).
    Batch { seq: u64, batch: Result<KvBatch, String> },
    /// The replay socket's end marker.
    ReplayEnd,
}
