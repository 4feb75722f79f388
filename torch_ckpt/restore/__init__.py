"""Reading a checkpoint back: planning, the checked read into new buffers, the copy into live tensors and the
choice of the step to resume.
"""
