//! Which ranks a request may go to: those with an endpoint in
//! `gateway.endpoints`, and of those, the ones in the gateway's subset
//! hint (`envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`).

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;

use dpcoord_daemon::config::Gateway;

/// The filter metadata namespace of the subset hint.
pub const NAMESPACE: &str = "envoy.lb.subset_hint";
/// Its key: a list of `host:port`.
pub const KEY: &str = "x-gateway-destination-endpoint-subset";

/// The subset hint of a request, if the gateway sent one.
pub fn hint(m: &Metadata) -> Option<Vec<String>> {
    let fields = &m.filter_metadata.get(NAMESPACE)?.fields;
    match fields.get(KEY)?.kind.as_ref()? {
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(s.split(',').map(|e| e.trim().to_owned()).collect()),
        _ => None,
    }
}

/// The ranks of `dp_size` the route query may pick from; a sentence for
/// the gateway's 503 when there is none.
pub fn eligible(gateway: &Gateway, dp_size: u32, subset: Option<&[String]>) -> Result<Vec<u32>, String> {
    let mapped = (0..dp_size).filter(|&r| gateway.endpoint(r).is_some());
    let ranks: Vec<u32> = match subset {
        None => mapped.collect(),
        Some(set) => mapped.filter(|&r| gateway.endpoint(r).is_some_and(|e| set.iter().any(|s| s == e))).collect(),
    };
    if !ranks.is_empty() {
        return Ok(ranks);
    }
    Err(match subset {
        Some(set) => format!(
            "no rank of dpcoord serves the subset hint [{}] (gateway.endpoints: [{}])",
            set.join(", "),
            gateway.endpoints.join(", ")
        ),
        None => format!("no rank of dp_size {dp_size} has an endpoint in gateway.endpoints"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subset_narrows_the_mapped_ranks() {
        let g = Gateway { endpoints: vec!["a:1".into(), "b:1".into(), "c:1".into()], ..Gateway::default() };
        assert_eq!(eligible(&g, 3, None), Ok(vec![0, 1, 2]));
        assert_eq!(eligible(&g, 4, None), Ok(vec![0, 1, 2]), "rank 3 has no endpoint");
        assert_eq!(eligible(&g, 3, Some(&["c:1".into(), "z:9".into()])), Ok(vec![2]));
        assert!(eligible(&g, 3, Some(&["z:9".into()])).unwrap_err().contains("[z:9]"));
        let one = Gateway { endpoints: vec!["a:1".into()], rank_header: Some("x".into()), ..Gateway::default() };
        assert_eq!(eligible(&one, 2, Some(&["a:1".into()])), Ok(vec![0, 1]));
    }
}
