"""Keras 3 model code: UNet3D and its blocks (imports Keras; import only inside commands)."""
