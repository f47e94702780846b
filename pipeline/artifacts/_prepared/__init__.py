"""The parts of pipeline/artifacts/prepared.py (data/prepared/), which re-exports every name: import them from there.

schema.py   the paths, the manifest's records, a split's arrays in memory
writer.py   Writer: the splits streamed into shards, the folder swapped in whole
storage.py  the `Files` protocol: this disk (LocalFiles) or the DVC remote (DvcRemoteFiles)
reader.py   SplitReader, read_split, ModelInput, read_manifest, read_test_files
"""
