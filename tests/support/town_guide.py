"""A ten-page town guide with two known facts per page, and twenty questions with the page that answers each."""

from __future__ import annotations

from tests.support.pdfs import make_pdf

FACTS_BY_PAGE = [
    ["The lighthouse on Korven Island was built in 1874 by the engineer Mara Lindqvist.",
     "Its lamp is visible from twenty-two nautical miles away on a clear night."],
    ["The Orchard bakery sells rye bread made with caraway seeds every Tuesday.",
     "The bakery's sourdough starter is more than forty years old."],
    ["The city library closes at eight in the evening on weekdays.",
     "Library members may borrow up to twelve books at once."],
    ["The river Alder floods each spring when the snow melts in the mountains.",
     "A stone bridge with seven arches crosses the Alder near the market square."],
    ["The greenhouse tomatoes grow faster under red LED lights.",
     "The greenhouse is heated with hot water from a geothermal well."],
    ["The chess club meets on Thursday nights in the old fire station.",
     "Its champion, Tomas Brandt, has won the regional chess title three times."],
    ["Train tickets to the capital cost fourteen euros for students.",
     "The night train to the capital departs from platform nine at 23:40."],
    ["The museum's oldest artifact is a bronze sword found in a peat bog.",
     "Entrance to the museum is free on the first Sunday of each month."],
    ["Beekeepers in the valley harvest heather honey in late August.",
     "A healthy beehive holds around fifty thousand bees in summer."],
    ["The volcano Hekla last erupted in the year 2000.",
     "Seismographs on the volcano's slopes record dozens of small earthquakes every week."],
]

FILLER = [
    "This guide is published by the town council for visitors and residents.",
    "Opening hours may change during public holidays, so please check before you travel.",
    "Maps of the town are available at the visitor centre next to the town hall.",
]

QUESTIONS = [
    ("When was the Korven lighthouse built?", 1),
    ("How far away can the lighthouse lamp be seen?", 1),
    ("Which day does the bakery sell rye bread?", 2),
    ("How old is the bakery's sourdough starter?", 2),
    ("What time does the library close?", 3),
    ("How many books can I borrow from the library?", 3),
    ("Why does the river Alder flood?", 4),
    ("How many arches does the bridge over the river have?", 4),
    ("What kind of light helps the tomatoes grow?", 5),
    ("How is the greenhouse heated?", 5),
    ("Where does the chess club meet?", 6),
    ("How many regional titles has the chess champion won?", 6),
    ("How much does a student ticket for the train to the capital cost?", 7),
    ("Which platform does the night train leave from?", 7),
    ("What is the oldest object in the museum?", 8),
    ("When can I visit the museum for free?", 8),
    ("When is heather honey harvested?", 9),
    ("How many bees live in a hive?", 9),
    ("When did Hekla last erupt?", 10),
    ("How often are earthquakes recorded on the volcano?", 10),
]


def town_guide_pdf() -> bytes:
    return make_pdf([[FILLER[page % 3], *facts, FILLER[(page + 1) % 3]] for page, facts in enumerate(FACTS_BY_PAGE)])
