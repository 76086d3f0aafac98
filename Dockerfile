# fleet-reconciler as a Fly app: a reproducible two-stage build.
#
#   fly deploy                      # builds this file on Fly's remote builder
#   docker build -t fleet-reconciler .
#
# The builder compiles the dependency graph first, from Cargo.toml and
# Cargo.lock alone (with stub sources), so that layer is reused until a
# dependency changes; then it compiles the crate itself. `--locked` fails the
# build instead of resolving new versions: the image has exactly the
# dependencies CI tested.
#
# The runtime image is Debian slim with what the binary links dynamically
# (`ldd target/release/fleet-reconciler`: zlib, libgcc, glibc) and the CA
# bundle git uses to verify the overlay host (found at start in the usual
# places, /etc/ssl/certs here). libgit2 and OpenSSL are vendored and linked
# statically. The Fly Machines API client uses rustls with bundled roots.
#
# No HEALTHCHECK: Fly ignores it. fly.toml's [checks] probe /healthz instead.

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS builder

# Nothing to install: cc, perl and make for the vendored libgit2 and OpenSSL
# come with the rust image.

WORKDIR /build

# 1. Dependencies only. The stubs stand in for every target Cargo.toml
#    declares (the binary, the library, the three benches), so cargo can
#    resolve the manifest and build the whole dependency graph. build.rs is
#    the real one: it only names the commit (`--version`). Both stages build
#    with `--no-default-features`: the production image carries neither the
#    simulator nor `demo` (the `sim` feature, README "Development").
COPY Cargo.toml Cargo.lock build.rs ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && for b in sweep scale soak; do echo 'fn main() {}' > "benches/$b.rs"; done \
 && cargo build --release --locked --no-default-features --bin fleet-reconciler \
 && rm -rf src benches

# 2. The crate. `config/` is needed at compile time too: the demo embeds
#    config/demo.toml. `touch` makes the real sources newer than the stubs'
#    build artefacts, whatever mtimes the build context carries.
#    The build context has no .git: the commit `--version` names comes from
#    this build arg (the release workflow passes the tag's commit), else it
#    says `unknown`.
COPY src ./src
COPY benches ./benches
COPY config ./config
ARG FLEET_RECONCILER_COMMIT=unknown
RUN touch src/main.rs src/lib.rs \
 && FLEET_RECONCILER_COMMIT="${FLEET_RECONCILER_COMMIT}" cargo build --release --locked --no-default-features --bin fleet-reconciler \
 && install -D -m 0755 target/release/fleet-reconciler /out/fleet-reconciler

FROM ${RUNTIME_IMAGE}

# The CA bundle for git's https transport. DL3008 (pin apt versions) is
# ignored on purpose: the base image pins the Debian release, and exact
# package pins break the build as soon as the security archive moves on (it
# keeps only the newest version).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed, numeric, unprivileged user. Fly mounts the volume for the image's
# user, so the bare mirror under /data is writable by it. The login shell is
# there for `fly ssh console -u fleet -C "fleet-reconciler check …"`, which
# must run as this user so that files it adds to the mirror stay writable by
# the daemon.
RUN groupadd --system --gid 10001 fleet \
 && useradd --system --uid 10001 --gid fleet --home-dir /data --no-create-home --shell /bin/sh fleet \
 && install -d -o fleet -g fleet -m 0750 /data \
 && install -d -m 0755 /etc/fleet-reconciler

# The image carries a config at the default path (`--config`, else
# $FLEET_RECONCILER_CONFIG, else this path), so `fleet-reconciler check` in
# `fly ssh console` needs no flag. On Fly, fly.toml's [[files]] writes the
# deployed config over it at boot: a config change needs no image rebuild.
# Build with another file: fly deploy --build-arg FLEET_CONFIG=path/to/file.toml
ARG FLEET_CONFIG=config/fleet-reconciler.toml
COPY ${FLEET_CONFIG} /etc/fleet-reconciler/fleet-reconciler.toml
COPY --from=builder /out/fleet-reconciler /usr/local/bin/fleet-reconciler

USER 10001:10001
WORKDIR /data
# server.listen of the shipped config: /metrics, /healthz, /readyz, /api/v1, status page.
EXPOSE 9090

ENTRYPOINT ["fleet-reconciler"]
CMD ["run", "--config", "/etc/fleet-reconciler/fleet-reconciler.toml"]
