import torch

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP barriers
# make them many times slower; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)
