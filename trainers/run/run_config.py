"""A trainer's config in one form: a frozen dataclass made once in `main` from the flags.

Every other form is derived from it field by field, so none restates its
field list: the loop's settings (`skeleton.LoopConfig.of`), a run's
identity (`RunConfig.identity`: the fields declared with `identity_field`,
the settings that shape the trajectory, which a resumed run must share with
its checkpoint and which HParams logs), and the values logged whole
(`RunConfig.flat_values`: TensorBoard's "config" text, `summary.json`).
"""

import dataclasses

_IDENTITY = "identity"
_CHANGEABLE = "changeable"


def identity_field(*, changeable=False, **kwargs):
    """A dataclass field that is part of a run's identity (see `identity`).

    Args:
        changeable: whether a resumed run may take another value
            (`--allow_config_change`): only a setting that takes effect
            after a restore (a learning rate, the batch), not one fixed by
            the initial weights or the model's variables.
        **kwargs: `dataclasses.field`'s.
    """
    return dataclasses.field(metadata={_IDENTITY: True, _CHANGEABLE: changeable}, **kwargs)


def changeable_field(**kwargs):
    """A field of a dataclass held by an identity field that a resumed run may change."""
    return dataclasses.field(metadata={_CHANGEABLE: True}, **kwargs)


class RunConfig:
    """The derived forms of a trainer's frozen dataclass config, which extends this.

    The fields declared with `identity_field` are the run's identity; the
    values logged whole are all fields, flat.
    """

    @classmethod
    def identity_names(cls):
        """The names of the identity fields, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get(_IDENTITY)]

    def identity(self):
        """The identity fields' values, flat (see `flat_values`)."""
        names = self.identity_names()
        return {k: v for k, v in self.flat_values().items() if k.split(".")[0] in names}

    def changeable_keys(self):
        """The keys of `identity()` that a resumed run may change (see `identity_field`)."""
        keys = set()
        for field in dataclasses.fields(self):
            if not field.metadata.get(_IDENTITY):
                continue
            value = getattr(self, field.name)
            if field.metadata.get(_CHANGEABLE):
                keys.add(field.name)
            if dataclasses.is_dataclass(value):
                keys |= {
                    f"{field.name}.{sub.name}"
                    for sub in dataclasses.fields(value)
                    if sub.metadata.get(_CHANGEABLE)
                }
        return keys

    def flat_values(self):
        """The fields by name; a field holding a dataclass gives "field.sub" keys instead."""
        values = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if dataclasses.is_dataclass(value):
                values.update(
                    {f"{field.name}.{k}": v for k, v in dataclasses.asdict(value).items()}
                )
            else:
                values[field.name] = value
        return values
