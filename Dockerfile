# syntax=docker/dockerfile:1
# dpcoord container image: a Rust build stage, then a slim Debian runtime
# holding only the binary and config/.
#
#   docker build -t dpcoord .
#   docker run --rm -p 5570:5570 -p 9570:9570 dpcoord \
#       --config /etc/dpcoord/dpcoord.toml \
#       --route-bind tcp://0.0.0.0:5570 --metrics-bind 0.0.0.0:9570
#
# The shipped /etc/dpcoord/dpcoord.toml binds loopback only (the contract's
# default). Inside a Kubernetes pod loopback is shared by the pod's
# containers, so an engine sidecar can use it as is; anything outside the
# container needs a config that binds 0.0.0.0 (or the pod IP), or ipc://
# endpoints in a volume shared with the engines: mount one over
# /etc/dpcoord/dpcoord.toml, or pass --config / flags (see
# deploy/kubernetes/ and docs/operations.md, "Deploy").

ARG RUST_VERSION=1
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
# zmq-sys builds libzmq from vendor/zeromq-src (libzmq 4.3.4 with dpcoord's
# patch, vendor/README.md) with the `cc` crate: it
# needs a C++ compiler (g++), not cmake or pkg-config. The slim Rust image
# has gcc and libc6-dev but no g++.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# .dockerignore keeps target/, .git, clients/ and fuzz/ out of the context.
COPY . .
RUN cargo build --release --locked --bin dpcoord \
 && strip --strip-debug target/release/dpcoord \
 && target/release/dpcoord check-config config/dpcoord.toml

FROM debian:${DEBIAN_RELEASE}-slim
# libstdc++6 and libgcc-s1 (libzmq is C++) are already in the slim image;
# they are named so that the dependency is explicit. HEALTHCHECK needs no
# curl: `dpcoord probe` does the GET itself.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libstdc++6 libgcc-s1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 dpcoord \
 && useradd --system --uid 10001 --gid dpcoord --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin dpcoord \
 && install -d -o dpcoord -g dpcoord -m 0755 /run/dpcoord
# /run/dpcoord is where the example configs put ipc:// endpoints
# (stats.sock): mount a volume there that the engine containers share.
COPY --from=build /src/target/release/dpcoord /usr/local/bin/dpcoord
COPY config/ /etc/dpcoord/
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# route, health, stats (ZeroMQ); metrics, /healthz, /readyz, /state (HTTP).
EXPOSE 5570 5571 5572 9570
ENV RUST_LOG=info
# Where `dpcoord probe` (HEALTHCHECK) looks: 127.0.0.1 reaches both the
# default loopback bind and 0.0.0.0. It exits 0 on 200, 1 otherwise, and
# gives up after 2 s (--timeout-ms), within HEALTHCHECK's --timeout.
ENV DPCOORD_HEALTH_URL=http://127.0.0.1:9570/healthz
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/dpcoord", "probe"]
# SIGTERM (docker stop) answers the queries in flight, closes the sockets and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/dpcoord"]
CMD ["--config", "/etc/dpcoord/dpcoord.toml"]
