"""Third-party integrations: peft's adapters (:mod:`.peft`), bitsandbytes' 4-bit layers (:mod:`.quantized`),
Ray Train's worker group (:mod:`.ray_train`) and torch.compile per repeated block
(:mod:`.regional_compilation`).

Nothing is imported here: each module is imported where it is used, and its third-party package only when
the user's model or environment already holds it.
"""
