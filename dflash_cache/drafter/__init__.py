"""The DFlash drafter: config and presets, model, anchors, masks, loss, checkpoints and export.

config.py (DrafterConfig, presets) · head.py (frozen target pieces) · inputs.py (DraftInputs) ·
anchors.py · masks.py (BlockMask) · attention.py · model.py (DFlashDrafter) · loss.py, head_loss.py ·
runner.py (eager / compiled) · checkpoint.py · reference.py, export.py (the reference layout)
"""
