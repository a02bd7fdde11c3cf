"""The CEL conformance suite (google/cel-spec ``tests/simple/testdata``) as test data.

``textproto`` reads its files (protobuf text format, no schema); ``testdata/`` holds the files
themselves with their licence and source (``testdata/SOURCE.md``).
"""
