# Put on PYTHONPATH by the slime harness: torchcodec's wheel (a verl dependency) fails to load its
# library against a CPU torch with an OSError that sglang's video decoder does not catch; an
# ImportError is what sglang expects when torchcodec is absent.
raise ImportError("torchcodec is blocked in the slime CPU harness (its native library needs a CUDA torch)")
