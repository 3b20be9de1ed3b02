from tests.tools.check_protos import proto_files, stale_files


def test_generated_protobuf_code_is_fresh():
    assert proto_files(), "no .proto files found"
    assert stale_files() == []
