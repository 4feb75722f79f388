"""Writing a checkpoint: staging into host memory, the asynchronous engine, persist (thread or writer process)
and the commit.
"""
