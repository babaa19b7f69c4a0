"""The context chunk-caches are warmed under.

A chunk-cache made right after the system prompt sits where, in a real prompt, no
chunk ever does: at the very start, next to the attention sink. Made after a page of
ordinary, unrelated prose instead, its tokens look like the mid-prompt tokens they
will be, and reusing it costs far less quality (``benchmarks/results/scaling_8k*.json``:
on six 7.9k-token prompts, plain reuse's first-token KL against a full prefill falls
from 0.61 to 0.13). The text below is that page: plain expository prose on unrelated
topics, written for cachecraft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

BUILTIN = "builtin"
NONE = "none"
SOURCE = "cachecraft warm context"

BUILTIN_TEXT = """\
Lighthouses

Before satellite navigation, ships approaching a coast at night depended on lighthouses.
Each tower showed a light with its own pattern of flashes, so that a navigator who
counted the seconds between them could tell which headland lay ahead. Keepers trimmed
wicks, wound the clockwork that turned the lens, and logged the weather every few
hours. Most lights are now automatic and are checked by a technician a few times a
year, but many towers still stand, and some have become small museums.

Bread

Bread is made from flour, water, salt and a leavening agent. When the dough is
kneaded, proteins in the flour form a stretchy network that traps the gas released by
yeast, and the loaf rises. Baking sets that network and browns the crust. Flatbreads
skip the rising step and cook in minutes on a hot surface. Sourdough relies on a
culture of wild yeast and bacteria kept alive by regular feeding, which gives the
bread its slightly sour taste and helps it keep for several days.

Rivers

A river carries water from high ground to a lake or the sea, and with the water it
carries sand, silt and dissolved minerals. Where the current slows, on the inside of a
bend or at the mouth, that material settles, and over centuries it builds beaches,
islands and wide flat deltas. Floods spread fertile soil over the surrounding plain,
which is one reason so many towns grew up along riverbanks despite the risk. Dams and
embankments now control many rivers, storing water for dry seasons and generating
electricity.

Libraries

A public library lends books, but it also offers newspapers, maps, recordings, quiet
rooms and, increasingly, computers and internet access. Books are arranged by subject
according to a classification scheme, so that works on the same topic stand together
on the shelves. A catalogue records the title, author, subject and location of every
item. Librarians help readers find information, run reading groups for children, and
keep local records such as old photographs and parish registers.

Bicycles

A bicycle turns the push of the rider's legs into forward motion through pedals, a
chain and a set of gears. Low gears make climbing easier; high gears allow more speed on
flat roads. The frame is usually steel, aluminium or carbon fibre, chosen for a balance
of weight, stiffness and cost. Tyres are inflated to a pressure that depends on the
road surface and the rider's weight, and brakes act either on the wheel rims or on
discs mounted at the hubs.

Weather

Weather is the state of the atmosphere at a given time and place: its temperature,
pressure, humidity, wind and cloud. Forecasters combine measurements from ground
stations, balloons, aircraft and satellites, and feed them into computer models that
divide the atmosphere into a grid and step it forward in time. Forecasts for the next
day or two are usually reliable; beyond a week, small errors in the starting data grow
large, and forecasts speak of probabilities rather than certainties.

Honeybees

A honeybee colony consists of a single queen, a few hundred male drones and tens of
thousands of female workers. Workers change tasks as they age: young bees clean cells
and feed larvae, older ones build comb and guard the entrance, and the oldest forage
for nectar and pollen. A forager that finds a good source of food returns to the hive
and performs a dance whose direction and length tell other bees where to fly. Nectar
is stored in wax cells and slowly thickened into honey.

Timekeeping

People first measured time by the sun, the moon and the seasons. Sundials divided the
day into hours, and water clocks and candles marked time at night. Mechanical clocks
appeared in European towers in the Middle Ages, and the pendulum later made them
accurate to within seconds a day. Today the official time is kept by atomic clocks,
which count the vibrations of atoms and lose less than a second in millions of years;
radio signals and networks pass that time to ordinary clocks and phones.
"""


def load_text(setting: str) -> str:
    """The warm context text for a ``warm_context`` setting: ``builtin``, ``none`` (empty),
    or the path of a UTF-8 text file."""
    if setting == BUILTIN:
        return BUILTIN_TEXT
    if setting == NONE:
        return ""
    from cachecraft.config import ConfigError

    path = Path(setting).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"warm_context {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "give a text file, 'builtin' or 'none'") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the warm_context file {path}: {exc.strerror}") from None


def token_ids(text: str, encode: Callable[[str], Sequence[int]], max_tokens: int, max_context: int) -> tuple[int, ...]:
    """The context's token ids, cut to ``max_tokens`` and to a quarter of the model's
    window ``max_context`` (the chunk still has to fit after it); empty for empty text."""
    if not text.strip():
        return ()
    return tuple(encode(text))[:min(max_tokens, max_context // 4)]
