"""rwkv7 checkpoints (placeholder until the rwkv7 converter lands): detects nothing."""

EXPECTS = "rwkv7: (not yet supported)"


def detect(directory):
    return None
