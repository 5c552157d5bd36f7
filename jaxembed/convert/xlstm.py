"""xlstm checkpoints (placeholder until the xlstm converter lands): detects nothing."""

EXPECTS = "xlstm: (not yet supported)"


def detect(directory):
    return None
