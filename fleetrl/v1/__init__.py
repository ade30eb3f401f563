"""Generated gRPC/protobuf code for the fleetrl.v1 protos (scripts/gen_proto.py)."""
