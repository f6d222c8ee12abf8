use super::keys::{chain_keys, chain_seed};
use super::*;
use crate::engines::kv::Stored;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    stored_on(hashes, parent, tokens, Medium::Gpu)
}

fn stored_on(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: Medium) -> KvEvent {
    KvEvent::Stored(Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size: 2,
        medium,
        lora: None,
        salt: None,
        unmatchable: None,
        group: 0,
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed { hashes: hashes.to_vec(), medium: Medium::Gpu, group: 0 }
}

/// The keys of `tokens` in blocks of 2, no LoRA, no salt.
fn keys_of(tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    chain_keys(chain_seed(None, None), tokens, 2, &mut out);
    out
}

fn leading(ix: &PrefixIndex, tokens: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    ix.leading(&keys_of(tokens), &mut out);
    out
}

const PROMPT: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

#[test]
fn stores_chain_across_events_and_leading_counts_each_rank() {
    let mut ix = PrefixIndex::new(3, 1000);
    // Rank 0 holds three blocks (in two events: the second continues the first).
    let a = ix.apply(0, &[stored(&[10, 11], None, &[1, 2, 3, 4]), stored(&[12], Some(11), &[5, 6])]);
    assert_eq!(a, Applied { stored: 2, blocks_stored: 3, ..Applied::default() });
    // Rank 2 holds the first block only, under its own engine hashes.
    ix.apply(2, &[stored(&[90], None, &[1, 2])]);
    assert_eq!(leading(&ix, &PROMPT), vec![3, 0, 1], "the partial block 7 has no key");
    assert_eq!(leading(&ix, &[1, 2, 9, 9]), vec![1, 0, 1]);
    assert_eq!(leading(&ix, &[2, 1]), vec![0, 0, 0]);
    assert_eq!((ix.block_size(), ix.blocks(0, Medium::Gpu), ix.distinct_keys()), (Some(2), 3, 3));
}

#[test]
fn removals_clears_and_bad_events() {
    let mut ix = PrefixIndex::new(2, 1000);
    ix.apply(0, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    ix.apply(1, &[stored(&[20, 21, 22], None, &[1, 2, 3, 4, 5, 6])]);
    // vLLM evicts a chain from its tail; an event naming an unknown hash
    // counts as unknown_block, and the known ones still go.
    let a = ix.apply(0, &[removed(&[12, 99])]);
    assert_eq!((a.removed, a.unknown_block, a.blocks_removed), (0, 1, 1));
    let a = ix.apply(0, &[removed(&[12])]);
    assert_eq!((a.removed, a.unknown_block), (0, 1), "already gone");
    assert_eq!(leading(&ix, &PROMPT), vec![2, 3]);
    // A middle block gone: the leading match stops there.
    assert_eq!(ix.apply(1, &[removed(&[21])]).removed, 1);
    assert_eq!(leading(&ix, &PROMPT), vec![2, 1]);
    // Unknown parent: dropped, nothing indexed.
    let a = ix.apply(1, &[stored(&[30], Some(77), &[9, 9])]);
    assert_eq!((a.unknown_parent, a.stored), (1, 0));
    // Wrong token count, then another block size: both bad.
    let a = ix.apply(1, &[stored(&[31], None, &[9, 9, 9])]);
    let other_size = KvEvent::Stored(Stored { block_size: 4, ..stored_event(&[32], &[1, 2, 3, 4]) });
    let b = ix.apply(1, &[other_size]);
    assert_eq!((a.bad_event, b.bad_event), (1, 1));
    let a = ix.apply(0, &[KvEvent::Cleared, KvEvent::Unindexable("pairs")]);
    assert_eq!((a.cleared, a.bad_event), (1, 1));
    assert_eq!((leading(&ix, &PROMPT), ix.blocks(0, Medium::Gpu)), (vec![0, 1], 0));
    // Rank 1's blocks 20 and 22 remain; 22 no longer leads anywhere.
    assert_eq!(ix.distinct_keys(), 2);
}

fn stored_event(hashes: &[u64], tokens: &[u32]) -> Stored {
    let KvEvent::Stored(s) = stored(hashes, None, tokens) else { unreachable!() };
    s
}

#[test]
fn other_media_are_indexed_apart_and_do_not_match() {
    let mut ix = PrefixIndex::new(1, 1000);
    ix.apply(0, &[stored(&[10], None, &[1, 2])]);
    // Offloaded to CPU, continuing a GPU parent.
    let a = ix.apply(0, &[stored_on(&[11], Some(10), &[3, 4], Medium::Cpu)]);
    assert_eq!(a.stored, 1);
    assert_eq!((ix.blocks(0, Medium::Gpu), ix.blocks(0, Medium::Cpu)), (1, 1));
    assert_eq!(leading(&ix, &PROMPT), vec![1]);
    // Removing on GPU leaves the CPU copy.
    ix.apply(0, &[removed(&[10])]);
    assert_eq!((ix.blocks(0, Medium::Gpu), ix.blocks(0, Medium::Cpu), ix.distinct_keys()), (0, 1, 0));
}

#[test]
fn the_cap_drops_the_oldest_blocks_first() {
    let mut ix = PrefixIndex::new(1, 8);
    for i in 0..8u32 {
        ix.apply(0, &[stored(&[u64::from(i)], None, &[i, i])]);
    }
    assert_eq!(ix.blocks(0, Medium::Gpu), 8);
    // The ninth store passes the cap: the newest 7 (8 - 8/8) stay.
    let a = ix.apply(0, &[stored(&[8], None, &[8, 8])]);
    assert_eq!((a.stored, a.evicted, ix.blocks(0, Medium::Gpu)), (1, 2, 7));
    assert_eq!(leading(&ix, &[0, 0]), vec![0]);
    assert_eq!(leading(&ix, &[1, 1]), vec![0]);
    assert_eq!(leading(&ix, &[2, 2]), vec![1]);
    assert_eq!(leading(&ix, &[8, 8]), vec![1]);
    assert_eq!(ix.distinct_keys(), 7);
}

#[test]
fn many_ranks_use_several_words_and_resize_drops_removed_ranks() {
    let mut ix = PrefixIndex::new(130, 1000);
    for rank in [0, 63, 64, 129] {
        ix.apply(rank, &[stored(&[u64::from(rank)], None, &[1, 2])]);
    }
    ix.apply(129, &[stored(&[500], Some(129), &[3, 4])]);
    let got = leading(&ix, &PROMPT);
    let held: Vec<(usize, u32)> = got.iter().copied().enumerate().filter(|&(_, n)| n > 0).collect();
    assert_eq!(held, vec![(0, 1), (63, 1), (64, 1), (129, 2)]);
    ix.resize(64);
    assert_eq!(leading(&ix, &PROMPT).iter().filter(|&&n| n > 0).count(), 2);
    assert_eq!(ix.distinct_keys(), 1, "the removed ranks' keys are gone");
    ix.resize(130);
    assert_eq!(leading(&ix, &PROMPT)[129], 0);
}

#[test]
fn the_block_size_is_learned_per_rank_and_only_from_an_applied_store() {
    let mut ix = PrefixIndex::new(2, 1000);
    // Dropped stores teach nothing: a wrong token count, an unknown parent.
    let bad = KvEvent::Stored(Stored { block_size: 999, ..stored_event(&[1], &[1, 2]) });
    let orphan = KvEvent::Stored(Stored { block_size: 8, parent: Some(5), ..stored_event(&[2], &[0; 8]) });
    let a = ix.apply(0, &[bad, orphan]);
    assert_eq!((a.bad_event, a.unknown_parent), (1, 1));
    assert_eq!((ix.block_size(), ix.rank_block_size(0)), (None, None));
    // Each rank keeps its own: rank 0 in blocks of 4, rank 1 of 2.
    let four = KvEvent::Stored(Stored { block_size: 4, ..stored_event(&[10], &[1, 2, 3, 4]) });
    assert_eq!(ix.apply(0, &[four]).stored, 1);
    ix.apply(1, &[stored(&[20], None, &[1, 2])]);
    assert_eq!(ix.apply(1, &[stored(&[21], Some(20), &[3, 4])]).stored, 1, "rank 0's size is not rank 1's");
    assert_eq!((ix.rank_block_size(0), ix.rank_block_size(1)), (Some(4), Some(2)));
    assert_eq!(ix.block_sizes(), [4, 2], "one rank each: the lowest rank's first");
    assert_eq!(leading(&ix, &PROMPT), vec![0, 2]);
    assert_eq!(ix.apply(0, &[stored(&[11], None, &[1, 2])]).bad_event, 1, "rank 0 stays at 4");
    // Its blocks cleared, the engine's size stays; forgotten (a restart, the
    // rank down), it is learned anew: the next engine may use another.
    ix.apply(0, &[KvEvent::Cleared]);
    assert_eq!((ix.blocks(0, Medium::Gpu), ix.rank_block_size(0)), (0, Some(4)));
    ix.forget(0);
    assert_eq!((ix.rank_block_size(0), ix.block_sizes()), (None, &[2][..]));
    assert_eq!(ix.apply(0, &[stored(&[11], None, &[1, 2])]).stored, 1);
    assert_eq!((ix.block_size(), leading(&ix, &PROMPT)), (Some(2), vec![1, 2]));
}

fn unmatchable_from(first: usize, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    let KvEvent::Stored(s) = stored(hashes, parent, tokens) else { unreachable!() };
    KvEvent::Stored(Stored { unmatchable: Some((first, "why")), ..s })
}

#[test]
fn unmatchable_blocks_are_held_never_matched_and_poison_what_continues_them() {
    let mut ix = PrefixIndex::new(2, 1000);
    // Rank 0: the first block keyed, the second (an image, say) and third not.
    let a = ix.apply(0, &[unmatchable_from(1, &[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    assert_eq!(a, Applied { unmatchable: 1, blocks_stored: 3, ..Applied::default() });
    assert_eq!((leading(&ix, &PROMPT), ix.blocks(0, Medium::Gpu)), (vec![1, 0], 3), "held, matched up to the cut");
    assert_eq!(ix.distinct_keys(), 1, "only the keyed block has a holder");
    // An event continuing an unmatchable block is unmatchable, not an unknown parent.
    let a = ix.apply(0, &[stored(&[13], Some(12), &[7, 8])]);
    assert_eq!(a, Applied { unmatchable: 1, blocks_stored: 1, ..Applied::default() });
    assert_eq!(leading(&ix, &[1, 2, 3, 4, 5, 6, 7, 8]), vec![1, 0]);
    // Their removal is a removal, and a keyed re-store of a hash makes it match again.
    let a = ix.apply(0, &[removed(&[13, 12])]);
    assert_eq!((a.removed, a.unknown_block, a.blocks_removed), (1, 0, 2));
    ix.apply(0, &[stored(&[11], Some(10), &[3, 4])]);
    assert_eq!(leading(&ix, &PROMPT), vec![2, 0]);
    // Re-stored as unmatchable, a keyed block stops matching.
    ix.apply(0, &[unmatchable_from(0, &[11], Some(10), &[3, 4])]);
    assert_eq!(leading(&ix, &PROMPT), vec![1, 0]);
    // Same prompt on rank 1 with every block unmatchable (lookahead hashes): no match.
    let a = ix.apply(1, &[unmatchable_from(0, &[20, 21, 22], None, &[1, 2, 3, 4, 5, 6])]);
    assert_eq!((a.unmatchable, ix.blocks(1, Medium::Gpu)), (1, 3));
    assert_eq!(leading(&ix, &PROMPT), vec![1, 0]);
    // A clear and the cap's sweep take unmatchable blocks like any other.
    assert_eq!(ix.apply(1, &[KvEvent::Cleared]).cleared, 1);
    assert_eq!((ix.blocks(1, Medium::Gpu), leading(&ix, &PROMPT)), (0, vec![1, 0]));
}

#[test]
fn an_unmatchable_event_applied_a_slice_at_a_time_cuts_at_the_same_block() {
    let tokens: Vec<u32> = (0..40).collect();
    let hashes: Vec<u64> = (100..120).collect();
    let ev = [unmatchable_from(7, &hashes, None, &tokens)];
    for budget in [1, 3, 7, 8, 100] {
        let mut ix = PrefixIndex::new(1, 1000);
        let mut at = Progress::default();
        while !ix.apply_some(0, &ev, &mut at, budget).1 {}
        assert_eq!((at.applied.unmatchable, at.applied.blocks_stored), (1, 20), "budget {budget}");
        assert_eq!(leading(&ix, &tokens), vec![7], "budget {budget}");
    }
}

/// `stored`'s event in KV cache group `group`.
fn in_group(group: u32, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    let KvEvent::Stored(s) = stored(hashes, parent, tokens) else { unreachable!() };
    KvEvent::Stored(Stored { group, ..s })
}

fn removed_in(group: u32, hashes: &[u64]) -> KvEvent {
    KvEvent::Removed { hashes: hashes.to_vec(), medium: Medium::Gpu, group }
}

/// A hybrid model (vLLM publishes each block once per group, the same
/// hashes): a rank's hit is the least of its groups' leading blocks.
#[test]
fn a_ranks_hit_is_the_least_over_the_kv_cache_groups_it_published() {
    let mut ix = PrefixIndex::new(3, 1000);
    let chain = [1, 2, 3, 4, 5, 6];
    // Rank 0: groups 0 and 1, the second event continuing the first in each.
    for g in [0, 1] {
        let a = ix.apply(0, &[in_group(g, &[10, 11], None, &chain[..4]), in_group(g, &[12], Some(11), &chain[4..])]);
        assert_eq!((a.stored, a.blocks_stored), (2, 3), "group {g}");
    }
    // Rank 1: group 0 only (a model with one group). Rank 2: nothing.
    ix.apply(1, &[stored(&[20, 21, 22], None, &chain)]);
    assert_eq!((leading(&ix, &PROMPT), ix.blocks(0, Medium::Gpu)), (vec![3, 3, 0], 6));
    // Group 1 (sliding window) drops a middle block: rank 0's hit stops there,
    // group 0's copy of the same hash stays.
    assert_eq!(ix.apply(0, &[removed_in(1, &[11])]).removed, 1);
    assert_eq!((leading(&ix, &PROMPT), ix.blocks(0, Medium::Gpu)), (vec![1, 3, 0], 5));
    // Group 0 drops block 12 too: the least is still group 1's.
    ix.apply(0, &[removed(&[12])]);
    assert_eq!(leading(&ix, &PROMPT), vec![1, 3, 0]);
    // Group 1 stores block 11 again, continuing its block 10: both hold 2.
    ix.apply(0, &[in_group(1, &[11], Some(10), &chain[2..4])]);
    assert_eq!(leading(&ix, &PROMPT), vec![2, 3, 0]);
    // A removal names its group: group 2 never held 10, nothing goes.
    let a = ix.apply(0, &[removed_in(2, &[10])]);
    assert_eq!((a.unknown_block, leading(&ix, &PROMPT)), (1, vec![2, 3, 0]));
    // Rank 2 publishes group 1 only: its hit is group 1's alone.
    ix.apply(2, &[in_group(1, &[30], None, &chain[..2])]);
    assert_eq!(leading(&ix, &PROMPT), vec![2, 3, 1]);
}

#[test]
fn a_published_group_holding_nothing_stops_the_hit_until_the_engine_restarts() {
    let mut ix = PrefixIndex::new(2, 1000);
    ix.apply(0, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    ix.apply(1, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    // Rank 0's group 1 holds another prompt only: nothing of this one.
    ix.apply(0, &[in_group(1, &[50], None, &[8, 8])]);
    assert_eq!(leading(&ix, &PROMPT), vec![0, 3]);
    assert_eq!(leading(&ix, &[8, 8]), vec![0, 0], "group 0 does not hold [8, 8]");
    // AllBlocksCleared empties every group; the rank still has two groups.
    let a = ix.apply(0, &[KvEvent::Cleared, stored(&[10, 11], None, &[1, 2, 3, 4])]);
    assert_eq!((a.cleared, ix.blocks(0, Medium::Gpu)), (1, 2));
    assert_eq!(leading(&ix, &PROMPT), vec![0, 3]);
    ix.apply(0, &[in_group(1, &[10, 11], None, &[1, 2, 3, 4])]);
    assert_eq!(leading(&ix, &PROMPT), vec![2, 3]);
    // A restart forgets the groups with the blocks: the next engine has one.
    ix.forget(0);
    ix.apply(0, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    assert_eq!(leading(&ix, &PROMPT), vec![3, 3]);
}

#[test]
fn a_group_beyond_the_index_is_held_unmatchable_and_the_rank_claims_nothing() {
    let mut ix = PrefixIndex::new(2, 1000);
    for rank in [0, 1] {
        ix.apply(rank, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    }
    ix.apply(0, &[in_group(MAX_GROUP, &[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    assert_eq!(leading(&ix, &PROMPT), vec![3, 3], "group 62 is indexed");
    let a = ix.apply(1, &[in_group(MAX_GROUP + 1, &[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    assert_eq!((a.unmatchable, a.stored, a.blocks_stored, ix.blocks(1, Medium::Gpu)), (1, 0, 3, 6));
    assert_eq!(leading(&ix, &PROMPT), vec![3, 0], "what group 63 holds is unknown");
    // Its blocks are removed by their group like any other.
    let a = ix.apply(1, &[removed_in(MAX_GROUP + 1, &[10, 11, 12])]);
    assert_eq!((a.removed, ix.blocks(1, Medium::Gpu)), (1, 3));
    assert_eq!(ix.distinct_keys(), 6, "group 0's keys and group 62's of rank 0");
}

#[test]
fn groups_narrow_ranks_past_the_first_word_of_64() {
    let mut ix = PrefixIndex::new(70, 1000);
    for rank in [3, 66, 69] {
        ix.apply(rank, &[stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    }
    ix.apply(66, &[in_group(1, &[10], None, &[1, 2])]);
    let out = leading(&ix, &PROMPT);
    assert_eq!((out[3], out[66], out[69], out.iter().sum::<u32>()), (3, 1, 3, 7));
}

/// A store of KV cache group `group` in blocks of `size`.
fn sized(group: u32, size: u32, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    let KvEvent::Stored(s) = stored(hashes, parent, tokens) else { unreachable!() };
    KvEvent::Stored(Stored { group, block_size: size, ..s })
}

/// Each rank's leading blocks of its own size for `tokens`, keyed in `sizes`.
fn leading_sized(ix: &PrefixIndex, tokens: &[u32], sizes: &[u32]) -> Vec<u32> {
    let keys: Vec<Vec<u64>> = sizes
        .iter()
        .map(|&s| {
            let mut out = Vec::new();
            chain_keys(chain_seed(None, None), tokens, s as usize, &mut out);
            out
        })
        .collect();
    let keyed: Vec<(u32, &[u64])> = sizes.iter().zip(&keys).map(|(&s, k)| (s, &k[..])).collect();
    let mut out = Vec::new();
    ix.leading_in(&keyed, &mut out, &mut Scratch::default());
    out
}

/// A hybrid model whose groups' blocks differ (full attention in blocks of
/// 4, a second group in blocks of 2): each group is learned and matched in
/// its own size, the rank's hit the least in tokens, in whole multiples of
/// the sizes' LCM, counted in the rank's own (group 0's) blocks.
#[test]
fn groups_of_different_block_sizes_are_each_matched_in_their_own() {
    let chain: Vec<u32> = (1..=9).collect();
    let mut ix = PrefixIndex::new(2, 1000);
    let a =
        ix.apply(0, &[sized(0, 4, &[10, 11], None, &chain[..8]), sized(1, 2, &[10, 20, 11, 21], None, &chain[..8])]);
    assert_eq!((a.stored, a.bad_event, a.blocks_stored), (2, 0, 6));
    ix.apply(1, &[sized(0, 4, &[30, 31], None, &chain[..8])]);
    assert_eq!((ix.rank_block_size(0), ix.block_sizes(), ix.block_size()), (Some(4), &[4, 2][..], Some(4)));
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![2, 2]);
    // Group 1 loses its third block (tokens 4..6): it holds 4 tokens, one block of 4.
    assert_eq!(ix.apply(0, &[removed_in(1, &[11])]).removed, 1);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![1, 2]);
    // Then its second: 2 tokens, less than the LCM of 4: none.
    ix.apply(0, &[removed_in(1, &[20])]);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![0, 2]);
    // Stored again, continuing its first block: whole again.
    ix.apply(0, &[sized(1, 2, &[20, 11], Some(10), &chain[2..6])]);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![2, 2]);
    // Keyed in blocks of 4 only (block_keys): group 1 matches nothing.
    assert_eq!(leading_sized(&ix, &chain, &[4]), vec![0, 2]);
    // Each group keeps its size: a store of 2 in group 0 (two blocks) is bad.
    assert_eq!(ix.apply(0, &[sized(0, 2, &[40, 41], None, &chain[..4])]).bad_event, 1);
}

/// vLLM's batch for a 9-token prompt of a model with full attention in
/// blocks of 4 beside a sliding window of 2 in blocks of 2 (the hash block
/// 2, the scheduler's 4): group 0's blocks, its partial block (the hash
/// unit the prompt's last token but one ends on), and group 1's blocks
/// that end on a multiple of 4, the only ones a hit can use.
#[test]
fn a_sliding_window_group_keeping_one_block_in_two_and_a_partial_block() {
    let chain: Vec<u32> = (1..=9).collect();
    let prompt = |n: usize| chain[..n].iter().copied().chain([99]).collect::<Vec<u32>>();
    let mut ix = PrefixIndex::new(2, 1000);
    let batch = [
        sized(0, 4, &[20, 40], None, &chain[..8]),
        sized(0, 2, &[30], Some(20), &chain[4..6]),
        sized(1, 2, &[20, 40], None, &chain[..8]),
    ];
    let a = ix.apply(0, &batch);
    assert_eq!((a.stored, a.unmatchable, a.bad_event, a.blocks_stored), (2, 1, 0, 5));
    ix.apply(1, &[sized(0, 4, &[20, 40], None, &chain[..8])]);
    assert_eq!(leading_sized(&ix, &prompt(8), &[4, 2]), vec![2, 2]);
    assert_eq!(leading_sized(&ix, &prompt(6), &[4, 2]), vec![1, 1], "the partial block is not matched");
    // The window loses the block ending at 8: the hit ends at 4.
    ix.apply(0, &[removed_in(1, &[40])]);
    assert_eq!(leading_sized(&ix, &prompt(8), &[4, 2]), vec![1, 2]);
    // The partial block's removal (its block filled) is a removal.
    let a = ix.apply(0, &[removed(&[30])]);
    assert_eq!((a.removed, a.unknown_block, ix.blocks(0, Medium::Gpu)), (1, 0, 3));
    // A sparse store continuing a block: which blocks its hashes are is
    // unknown, so they are held and never matched.
    let a = ix
        .apply(0, &[sized(1, 2, &[40, 60], Some(20), &chain[2..8].iter().chain(&[7, 7]).copied().collect::<Vec<_>>())]);
    assert_eq!((a.unmatchable, a.stored, ix.blocks(0, Medium::Gpu)), (1, 0, 5));
    assert_eq!(leading_sized(&ix, &prompt(8), &[4, 2]), vec![1, 2]);
    // A store whose hashes fit no window is held too; one without hashes is bad.
    let a = ix.apply(0, &[sized(1, 2, &[70], None, &[5; 8]), sized(1, 2, &[], None, &[5; 8])]);
    assert_eq!((a.unmatchable, a.bad_event), (1, 1));
    // A rank of one group of 4 takes no store of 2 blocks for a sparse one,
    // nor a one-block store of 2 for a partial block (vLLM hashes in 4).
    assert_eq!(ix.apply(1, &[sized(0, 4, &[80], None, &chain[..8])]).bad_event, 1);
    assert_eq!(ix.apply(1, &[sized(0, 2, &[81], None, &chain[..2])]).bad_event, 1);
    // Rank 0's groups of 4 and 2 learned: a partial block alone in its batch.
    let a = ix.apply(0, &[sized(0, 2, &[31], Some(40), &[5, 5])]);
    assert_eq!((a.unmatchable, a.bad_event), (1, 0));
}

/// A group of a third size: the hit is in multiples of the three sizes'
/// LCM; a size not keyed leaves the rank no match.
#[test]
fn a_group_of_a_third_size() {
    let chain: Vec<u32> = (1..=25).collect();
    let mut ix = PrefixIndex::new(1, 1000);
    let h = |n: u64, base: u64| (base..base + n).collect::<Vec<u64>>();
    let a = ix.apply(
        0,
        &[
            sized(0, 4, &h(6, 100), None, &chain[..24]),
            sized(1, 2, &h(12, 200), None, &chain[..24]),
            sized(2, 6, &h(4, 300), None, &chain[..24]),
        ],
    );
    assert_eq!((a.stored, a.blocks_stored), (3, 22));
    assert_eq!(ix.block_sizes(), [4, 2, 6]);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2, 6]), vec![6]);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![0], "group 2's size is not keyed");
    // Group 2 loses its last block (tokens 18..24): 18 tokens, 12 in the LCM's multiples.
    ix.apply(0, &[removed_in(2, &[303])]);
    assert_eq!(leading_sized(&ix, &chain, &[6, 4, 2]), vec![3]);
    assert_eq!(leading(&ix, &chain), vec![0], "keys of 2 alone: groups 0 and 2 match nothing");
}

/// An engine restarted with other sizes is learned anew; until then every
/// store of another size is bad.
#[test]
fn a_rank_whose_engine_restarts_with_other_sizes_learns_them_anew() {
    let chain: Vec<u32> = (1..=9).collect();
    let mut ix = PrefixIndex::new(1, 1000);
    ix.apply(0, &[sized(0, 4, &[10, 11], None, &chain[..8]), sized(1, 2, &[20, 21, 22, 23], None, &chain[..8])]);
    assert_eq!(leading_sized(&ix, &chain, &[4, 2]), vec![2]);
    let a = ix.apply(0, &[sized(1, 4, &[30, 31], None, &chain[..8])]);
    assert_eq!(a.bad_event, 1, "group 1 is of 2");
    ix.forget(0);
    assert_eq!((ix.rank_block_size(0), ix.block_sizes()), (None, &[][..]));
    // The next engine: group 0 in blocks of 2, group 1 of 4.
    let a =
        ix.apply(0, &[sized(0, 2, &[40, 41, 42, 43], None, &chain[..8]), sized(1, 4, &[50, 51], None, &chain[..8])]);
    assert_eq!((a.stored, a.bad_event), (2, 0));
    assert_eq!((ix.rank_block_size(0), ix.block_sizes()), (Some(2), &[2, 4][..]));
    assert_eq!(leading_sized(&ix, &chain, &[2, 4]), vec![4]);
    ix.apply(0, &[removed_in(1, &[51])]);
    assert_eq!(leading_sized(&ix, &chain, &[2, 4]), vec![2]);
}
