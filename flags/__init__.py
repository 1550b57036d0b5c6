"""Shared absl flag definitions for the keras-bn trainers.

Import the modules by name, never star-import, and alias them so the package
never shadows `absl.flags`:

    from flags import run_flags as run_flags
    from flags import training_flags as training_flags
    from flags import distribution_flags as distribution_flags

Importing a module defines its flags once; the trainers read the holders'
`.value` in `main` only.
"""
