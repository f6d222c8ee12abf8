//! The picker's answers to the gateway, as Envoy's `ext_proc` messages.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3 as ep;
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use ep::processing_response::Response as Out;

/// The header (and `envoy.lb` metadata key) that names the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The header the gateway adds to the response: the endpoint that served it.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// A pick to hand the gateway.
pub struct Pick<'a> {
    /// The picked endpoint, then its fallbacks: `ip:port,ip:port,...`.
    pub endpoint: &'a str,
    pub rank: u32,
    /// The header that carries the rank (one endpoint for every rank).
    pub rank_header: Option<&'a str>,
}

fn message(r: Out) -> ep::ProcessingResponse {
    ep::ProcessingResponse { response: Some(r), ..Default::default() }
}

pub fn headers_ok() -> ep::ProcessingResponse {
    message(Out::RequestHeaders(ep::HeadersResponse::default()))
}

pub fn response_headers_ok() -> ep::ProcessingResponse {
    message(Out::ResponseHeaders(ep::HeadersResponse::default()))
}

pub fn request_trailers_ok() -> ep::ProcessingResponse {
    message(Out::RequestTrailers(ep::TrailersResponse::default()))
}

pub fn response_trailers_ok() -> ep::ProcessingResponse {
    message(Out::ResponseTrailers(ep::TrailersResponse::default()))
}

/// A response body chunk passed on: echoed back in full-duplex streaming
/// (the gateway forwards what the processor returns), else left as it is.
pub fn response_body(b: &ep::HttpBody, streamed: bool) -> ep::ProcessingResponse {
    let common = streamed.then(|| ep::CommonResponse {
        body_mutation: Some(streamed_body(b.body.clone(), b.end_of_stream)),
        ..Default::default()
    });
    message(Out::ResponseBody(ep::BodyResponse { response: common }))
}

fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> ep::BodyMutation {
    ep::BodyMutation {
        mutation: Some(ep::body_mutation::Mutation::StreamedResponse(ep::StreamedBodyResponse {
            body,
            end_of_stream,
            ..Default::default()
        })),
    }
}

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_owned(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_owned())) }
}

/// `envoy.lb` / `x-gateway-destination-endpoint`: the endpoint.
fn lb_metadata(endpoint: &str) -> Struct {
    let inner = Struct { fields: [(DESTINATION.to_owned(), string(endpoint))].into() };
    Struct { fields: [("envoy.lb".to_owned(), Value { kind: Some(Kind::StructValue(inner)) })].into() }
}

/// The answer to a request's headers that name its endpoint: a request
/// without a body, whose headers are all the picker sees.
pub fn picked_headers(p: &Pick<'_>) -> ep::ProcessingResponse {
    let common = ep::CommonResponse {
        header_mutation: Some(ep::HeaderMutation { set_headers: pick_headers(p), ..Default::default() }),
        clear_route_cache: true,
        ..Default::default()
    };
    let r = Out::RequestHeaders(ep::HeadersResponse { response: Some(common) });
    ep::ProcessingResponse { response: Some(r), dynamic_metadata: Some(lb_metadata(p.endpoint)), ..Default::default() }
}

/// The destination header, and the rank header when the gateway uses one.
fn pick_headers(p: &Pick<'_>) -> Vec<HeaderValueOption> {
    let mut set = vec![header(DESTINATION, p.endpoint)];
    if let Some(h) = p.rank_header {
        set.push(header(h, &p.rank.to_string()));
    }
    set
}

/// What the gateway gets for a pick: the destination header (and the
/// rank header), the same endpoint in the `envoy.lb` metadata, and in
/// full-duplex streaming the body, which the gateway forwards as returned.
/// Buffered, the headers ride on the body's answer.
pub fn picked(p: &Pick<'_>, body: Vec<u8>, buffered: bool) -> Vec<ep::ProcessingResponse> {
    let mutation = Some(ep::HeaderMutation { set_headers: pick_headers(p), ..Default::default() });
    let common = ep::CommonResponse { header_mutation: mutation, clear_route_cache: true, ..Default::default() };
    let metadata = Some(lb_metadata(p.endpoint));
    if buffered {
        let r = Out::RequestBody(ep::BodyResponse { response: Some(common) });
        return vec![ep::ProcessingResponse { response: Some(r), dynamic_metadata: metadata, ..Default::default() }];
    }
    let headers = Out::RequestHeaders(ep::HeadersResponse { response: Some(common) });
    let body = ep::CommonResponse { body_mutation: Some(streamed_body(body, true)), ..Default::default() };
    vec![
        ep::ProcessingResponse { response: Some(headers), dynamic_metadata: metadata, ..Default::default() },
        message(Out::RequestBody(ep::BodyResponse { response: Some(body) })),
    ]
}

/// An immediate response to the client: `code` and why, as plain text.
pub fn immediate(code: u16, why: &str) -> ep::ProcessingResponse {
    message(Out::ImmediateResponse(ep::ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(code) }),
        body: format!("dpcoord: {why}\n").into_bytes(),
        details: format!("dpcoord_{code}"),
        ..Default::default()
    }))
}

/// The endpoint that served the request, as the protocol has the gateway
/// say it: `envoy.lb` / `x-gateway-destination-endpoint-served` in the
/// filter metadata of the response's messages.
pub fn served_metadata(m: &Metadata) -> Option<String> {
    match m.filter_metadata.get("envoy.lb")?.fields.get(SERVED)?.kind.as_ref()? {
        Kind::StringValue(s) => first_endpoint(s),
        _ => None,
    }
}

/// The first of a comma-separated endpoint list.
fn first_endpoint(list: &str) -> Option<String> {
    list.split(',').next().map(|e| e.trim().to_owned())
}

/// A header's value: Envoy sends `raw_value`, older senders `value`.
fn header_value(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// A request's `:method`, if its headers carry one.
pub fn method(headers: Option<&HeaderMap>) -> Option<String> {
    headers?.headers.iter().find(|h| h.key == ":method").map(header_value)
}

/// The response's `:status` and the endpoint that served it (`served`).
pub fn response_facts(headers: Option<&HeaderMap>, served: &str) -> (Option<u16>, Option<String>) {
    let (mut status, mut endpoint) = (None, None);
    for h in headers.map(|m| m.headers.as_slice()).unwrap_or_default() {
        let value = header_value(h);
        if h.key == ":status" {
            status = value.trim().parse().ok();
        } else if h.key.eq_ignore_ascii_case(served) {
            endpoint = first_endpoint(&value);
        }
    }
    (status, endpoint)
}
