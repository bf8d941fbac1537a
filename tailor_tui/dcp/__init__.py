"""PyTorch Distributed Checkpoint (DCP) files, read and written without torch: the `.metadata` file
torch's `FileSystemWriter` pickles (`metadata`) and the chunks its `.distcp` files hold, each a
torch.save archive of one rectangular piece of a tensor or of one small value (`chunks`).
"""

__all__ = ["chunks", "metadata"]
