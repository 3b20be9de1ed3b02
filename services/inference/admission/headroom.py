"""What a call must leave free for others when it is admitted: the headroom kept for modest tenants and tenants
under their share (shares.py) and for active higher-priority classes (priorities.py). No torch.

Headroom is kept three ways, so that the call it is kept for finds room at once: free slots; room in time, as
phantom calls that must still meet their deadlines beside the running ones and the new one; and room in the next
step's token budget for some of those phantoms' prompts. The controller checks all three (controller.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .decisions import Commitment
from .priorities import Priorities
from .shares import Shares


@dataclass(frozen=True, slots=True)
class Headroom:
    for_tenants: int = 0  # free slots kept for other tenants
    for_classes: int = 0  # free slots kept for higher-priority classes
    phantoms: tuple[Commitment, ...] = ()  # calls that must still fit in time: the tenants' first, then the classes'
    num_tenant_phantoms: int = 0
    prompts: tuple[Commitment, ...] = ()  # the phantoms whose prompts keep room in the next step's token budget

    @property
    def num_slots(self) -> int:
        return self.for_tenants + self.for_classes


NONE = Headroom()


def headroom(shares: Shares, priorities: Priorities, new: Commitment, now_ns: int) -> Headroom:
    """The headroom `new` must leave: O(active tenants + active classes) to find, a phantom per kept slot."""
    for_tenants = shares.kept_free(new.tenant, now_ns)
    above = priorities.above(new.priority, now_ns)
    if not for_tenants and not above:
        return NONE
    # a phantom of a tenant is shaped as `new` (its deadline too); a phantom of a class as that class's latest call
    phantoms = [
        Commitment(f"\0kept{i}", new.num_prompt_tokens, new.max_tokens, new.deadline_ns) for i in range(for_tenants)
    ]
    # room in the next step for a few prompts, whichever tenant's call comes first, and whichever class's
    tenant_prompts, class_prompts = phantoms[: shares.per_tenant_prompts], []
    for level, kept in enumerate(above):
        mine = [
            Commitment(f"\0class{level}/{i}", kept.num_prompt_tokens, kept.max_tokens, now_ns + kept.budget_ns)
            for i in range(kept.num_slots)
        ]
        phantoms += mine
        class_prompts += mine[: priorities.per_class_prompts - len(class_prompts)]
    return Headroom(
        for_tenants=for_tenants,
        for_classes=len(phantoms) - for_tenants,
        phantoms=tuple(phantoms),
        num_tenant_phantoms=for_tenants,
        prompts=(*tenant_prompts, *class_prompts),
    )


def holding_against(new: Commitment, room: Headroom, reservations: list[Commitment]) -> list[Commitment]:
    """The reservations that hold their slots against `new`: all but those of a lower class, unless `new` must keep
    headroom for other tenants (a tenant over its share takes no slot reserved for another, whatever its class)."""
    if room.for_tenants:
        return reservations
    return [r for r in reservations if r.priority >= new.priority]
