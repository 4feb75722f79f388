"""What a checkpoint is on disk: the manifest, listed files, the values codec, DCP metadata, records, and the DCP
writer and reader.
"""
