"""The decode loops: CUDA-graph capture and replay of a decode step, the greedy and beam loops on
device-resident state, and the host-driven loops for the modes graphs do not serve.
"""
