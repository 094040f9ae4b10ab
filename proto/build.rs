//! Compiles the wire contract in `proto/` with a vendored protoc, so a fresh machine needs no
//! system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/flotilla/v1/session.proto",
        "proto/flotilla/v1/registration.proto",
    ];
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // A join request carries the bootstrap token: its Debug is written by hand (in lib.rs) so
    // the secret cannot reach a log through `{:?}`.
    config.skip_debug(["flotilla.v1.JoinRequest"]);
    // Resource lists compare and serialise in name order, so an unchanged report is equal.
    config.btree_map([".flotilla.v1.ClusterInfo"]);
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Channel construction belongs to the binaries that dial; proto stays free of transport.
        .build_transport(false)
        .compile_with_config(config, &protos, &["proto"])?;
    Ok(())
}
