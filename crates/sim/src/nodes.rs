//! Data parallelism over nodes, as vLLM runs it with `--data-parallel-size
//! N --data-parallel-size-local N/nodes --data-parallel-hybrid-lb`: each
//! node's API servers reach only that node's ranks (vLLM's
//! `DPLBAsyncMPClient` manages `engine_ranks_managed`, global ranks `start
//! .. start + local`), and a load balancer in front hands requests to the
//! nodes in turn, blind to their load.
//!
//! The run's frontends are then the clients' request streams, and its API
//! servers are split evenly over the nodes, API server `a` on node `a /
//! (servers / nodes)`, its local index there `a % (servers / nodes)`. The
//! balancer is round robin per frontend: the `j`-th request frontend `f`
//! issues (from 0) goes to node `(f + j) % nodes`, to that node's API server
//! of local index `(f / nodes) % (servers / nodes)`; a retry stays with it.
//! With 2 nodes, frontend 0 sends to node 0, 1, 0, ... and frontend 1 to
//! node 1, 0, 1, ...; at 4 API servers, frontends 0 and 1 share each
//! node's first API server, frontends 2 and 3 its second.

use std::ops::Range;

/// How API servers and ranks split over nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nodes {
    nodes: u32,
    /// API servers over all nodes.
    servers: u32,
    /// DP ranks over all nodes.
    ranks: u32,
}

impl Nodes {
    /// `servers` API servers and `ranks` ranks split over `nodes` nodes
    /// (node `n`'s ranks: `n * ranks / nodes .. (n + 1) * ranks / nodes`).
    /// The caller sees to it that `nodes` divides `servers` and is at
    /// most `ranks`.
    pub fn new(nodes: u32, servers: u32, ranks: u32) -> Nodes {
        let servers = servers.max(1);
        let nodes = nodes.clamp(1, servers.min(ranks.max(1)));
        Nodes { nodes, servers, ranks }
    }

    /// Everything on one node.
    pub fn one(servers: u32, ranks: u32) -> Nodes {
        Nodes::new(1, servers, ranks)
    }

    pub fn count(&self) -> u32 {
        self.nodes
    }

    /// API servers over all nodes.
    pub fn servers(&self) -> u32 {
        self.servers
    }

    /// API servers on each node (vLLM's `client_count` there).
    pub fn per_node(&self) -> u32 {
        (self.servers / self.nodes).max(1)
    }

    /// The node of API server `server`.
    pub fn node_of(&self, server: u32) -> u32 {
        (server / self.per_node()).min(self.nodes - 1)
    }

    /// API server `server`'s index among its node's (vLLM's `client_index` there).
    pub fn local_index(&self, server: u32) -> u32 {
        server % self.per_node()
    }

    /// Node `node`'s global ranks.
    pub fn ranks_of(&self, node: u32) -> Range<u32> {
        let at = |n: u32| (u64::from(n) * u64::from(self.ranks) / u64::from(self.nodes)) as u32;
        at(node)..at(node + 1)
    }

    /// The API server the front balancer hands the `nth` request (from 0)
    /// of frontend `frontend`.
    pub fn server_for(&self, frontend: u32, nth: u64) -> u32 {
        let node = ((u64::from(frontend) + nth) % u64::from(self.nodes)) as u32;
        node * self.per_node() + (frontend / self.nodes) % self.per_node()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_nodes_split_the_api_servers_and_ranks_evenly() {
        let two = Nodes::new(2, 2, 8);
        assert_eq!((two.per_node(), two.node_of(0), two.node_of(1)), (1, 0, 1));
        assert_eq!((two.local_index(0), two.local_index(1)), (0, 0));
        assert_eq!((two.ranks_of(0), two.ranks_of(1)), (0..4, 4..8));
        let four = Nodes::new(2, 4, 8);
        assert_eq!(four.per_node(), 2);
        assert_eq!((0..4).map(|a| four.node_of(a)).collect::<Vec<_>>(), [0, 0, 1, 1]);
        assert_eq!((0..4).map(|a| four.local_index(a)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        let one = Nodes::one(4, 8);
        assert_eq!((one.count(), one.per_node(), one.ranks_of(0)), (1, 4, 0..8));
        assert_eq!(
            (0..4).map(|a| (one.node_of(a), one.local_index(a))).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2), (0, 3)]
        );
    }

    #[test]
    fn each_frontends_requests_alternate_between_the_nodes() {
        let two = Nodes::new(2, 2, 8);
        let of = |n: &Nodes, f| (0..4).map(|j| n.server_for(f, j)).collect::<Vec<_>>();
        assert_eq!(of(&two, 0), [0, 1, 0, 1]);
        assert_eq!(of(&two, 1), [1, 0, 1, 0]);
        // 4 API servers (0, 1 on node 0; 2, 3 on node 1): frontends 0 and 1 use each node's
        // first, 2 and 3 its second.
        let four = Nodes::new(2, 4, 8);
        assert_eq!(of(&four, 0), [0, 2, 0, 2]);
        assert_eq!(of(&four, 1), [2, 0, 2, 0]);
        assert_eq!(of(&four, 2), [1, 3, 1, 3]);
        assert_eq!(of(&four, 3), [3, 1, 3, 1]);
        // Over the frontends' first requests, every API server gets its share.
        let mut got = [0; 4];
        for f in 0..4 {
            for j in 0..10 {
                got[four.server_for(f, j) as usize] += 1;
            }
        }
        assert_eq!(got, [10; 4]);
        assert_eq!(of(&Nodes::one(2, 8), 1), [1; 4], "one node: frontend f is API server f");
    }
}
