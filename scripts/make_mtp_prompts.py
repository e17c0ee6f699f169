#!/usr/bin/env python3
"""Writes data/mtp_prompts.jsonl: the prompt set `tandem train-mtp` continues by default (the
shipped head's recipe, docs/HEADS.md). Everyday chat requests made from templates and topic
lists, deterministic (a fixed seed), one JSON string a line.

None of them is one of the held-out benchmark prompts (bench/prompts/chat50.jsonl), and no
topic of those is used here: the shipped head is measured on prompts it never saw.

    python3 scripts/make_mtp_prompts.py [--n 1600] [--out data/mtp_prompts.jsonl]
"""
import argparse
import json
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parent.parent

CONCEPTS = [
    "inflation", "compound interest", "a budget", "supply and demand", "democracy",
    "the immune system", "vaccines", "DNA", "evolution", "plate tectonics", "earthquakes",
    "volcanoes", "electricity", "magnetism", "a battery", "solar power", "wind energy",
    "nuclear energy", "the internet", "a web browser", "an operating system", "a database",
    "machine learning", "encryption", "a password manager", "cloud storage", "a spreadsheet",
    "the stock market", "a mortgage", "credit scores", "the greenhouse effect", "erosion",
    "the food chain", "digestion", "the nervous system", "memory", "dreams", "habits",
    "photosynthesis in algae", "friction", "momentum", "sound waves", "echoes", "magnets",
    "tsunamis", "glaciers", "deserts", "rainforests", "coral reefs", "the ozone layer",
    "the printing press", "the Roman Empire", "the Renaissance", "the Industrial Revolution",
    "ancient Egypt", "the Silk Road", "the Olympic Games", "chess", "jazz music", "poetry",
    "a sonnet", "a metaphor", "irony", "a novel", "a short story", "grammar", "punctuation",
    "a noun", "a verb", "an adjective", "fractions", "percentages", "probability", "averages",
    "the Pythagorean theorem", "algebra", "geometry", "a triangle", "a circle", "pi",
    "negative numbers", "multiplication", "long division", "a calendar", "time zones",
    "a compass", "maps", "latitude and longitude", "satellites", "GPS", "the Moon landing",
    "Mars", "Jupiter", "comets", "stars", "the Sun", "galaxies", "telescopes", "microscopes",
    "bacteria in yogurt", "fermentation", "bread rising", "caffeine", "sugar", "protein",
    "vitamins", "hydration", "stretching", "meditation", "mindfulness", "procrastination",
    "teamwork", "leadership", "public speaking", "negotiation", "customer service",
    "a resume", "a cover letter", "networking", "freelancing", "a small business",
    "marketing", "a brand", "social media", "podcasts", "video games", "board games",
    "origami", "knitting", "gardening", "composting", "bird watching", "photography",
    "painting with watercolors", "drawing", "sculpture", "architecture", "bridges",
    "skyscrapers", "trains", "electric cars", "bicycles", "sailing", "submarines",
    "rockets", "the water treatment process", "recycling plastic bottles", "paper making",
]

ACTIVITIES = [
    "saving money", "learning a new language", "running a first 5k", "cooking for a family",
    "keeping a journal", "reading more books", "waking up early", "staying hydrated",
    "organizing a closet", "working from home", "planning a birthday party",
    "traveling on a budget", "moving to a new city", "making new friends", "learning to swim",
    "practicing the piano", "writing a blog", "starting a podcast", "taking better photos",
    "growing tomatoes", "keeping a fish tank", "training a puppy", "caring for a cat",
    "baking bread", "meal prepping", "reducing screen time", "managing stress",
    "preparing for an exam", "giving a presentation", "writing a speech", "learning to code",
    "decluttering a kitchen", "painting a room", "fixing a leaky faucet", "riding a bike in the city",
    "camping with kids", "packing for a beach vacation", "staying warm in winter",
    "keeping a car in good shape", "shopping for groceries", "cleaning a bathroom",
    "studying math", "memorizing vocabulary", "writing neatly", "drawing portraits",
    "making a budget spreadsheet", "volunteering", "hosting a dinner", "choosing a laptop",
]

THINGS = [
    "the ocean at night", "a city in the rain", "an old lighthouse", "a snowy forest",
    "a busy market", "a quiet library", "a summer storm", "a mountain lake", "a train journey",
    "the first day of spring", "a campfire", "a lost umbrella", "a red bicycle",
    "a paper boat", "a sleeping dog", "a cup of tea", "a garden at dawn", "a desert road",
    "an empty playground", "a hot air balloon", "the stars over a field", "a windy beach",
    "a lonely robot", "a friendly dragon", "a clock tower", "a winter morning",
    "a river in the valley", "a field of sunflowers", "a school bus", "a violin",
]

CHARACTERS = [
    "a young inventor", "a retired sailor", "a curious fox", "a shy robot", "a baker",
    "a detective", "a little girl", "an old gardener", "a talking cat", "a space explorer",
    "a knight", "a village doctor", "a street musician", "a lighthouse keeper", "a wizard",
    "a teenage chess player", "a mail carrier", "a penguin", "a librarian", "a firefighter",
]

SITUATIONS = [
    "finds a map in the attic", "wakes up in a strange town", "has to win a race",
    "loses their voice before a concert", "discovers a hidden door", "makes a new friend",
    "gets lost in a forest", "receives a mysterious letter", "builds a machine that talks",
    "must solve a puzzle to get home", "finds a baby bird", "travels back in time",
    "opens a small shop", "learns to fly", "meets a ghost who is afraid of people",
]

ANIMALS = [
    "elephants", "dolphins", "owls", "penguins", "giraffes", "wolves", "koalas", "sharks",
    "ants", "butterflies", "frogs", "horses", "parrots", "turtles", "whales", "bats",
    "squirrels", "camels", "crows", "jellyfish", "lions", "pandas", "snails", "hedgehogs",
]

DISHES = [
    "vegetable soup", "a tomato pasta", "banana bread", "a fruit salad", "fried rice",
    "guacamole", "a simple omelette", "chocolate chip cookies", "a chicken curry",
    "a lentil stew", "mashed potatoes", "a green smoothie", "roasted vegetables",
    "a grilled cheese sandwich", "homemade pizza", "a potato salad", "oatmeal with apples",
    "hummus", "a bean chili", "apple crumble", "a cucumber salad", "garlic bread",
]

PLACES = [
    "Tokyo", "Rome", "New York", "the Sahara", "Iceland", "the Amazon river", "Paris in winter",
    "a Swiss village", "Cairo", "Sydney", "the Grand Canyon", "a night market in Bangkok",
    "London", "a Greek island", "Kyoto", "the Scottish Highlands", "Rio de Janeiro", "Venice",
]

PAIRS = [
    ("a cat", "a dog"), ("tea", "coffee"), ("a book", "its movie"), ("trains", "planes"),
    ("renting", "buying a home"), ("running", "swimming"), ("a laptop", "a tablet"),
    ("summer", "winter"), ("email", "a phone call"), ("cities", "the countryside"),
    ("a savings account", "investing"), ("paper books", "e-books"), ("Python", "JavaScript"),
    ("a violin", "a cello"), ("baking", "frying"), ("a hurricane", "a tornado"),
    ("frogs", "toads"), ("a comet", "an asteroid"), ("an ocean", "a river"),
]

RECIPIENTS = [
    ("my landlord", "a broken heater"), ("a colleague", "a missed deadline"),
    ("my manager", "taking a day off"), ("a neighbor", "loud music at night"),
    ("a customer", "a delayed order"), ("my team", "a project update"),
    ("a friend", "a birthday invitation"), ("a hotel", "changing a booking"),
    ("a professor", "an extension on an essay"), ("a new client", "our first meeting"),
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is even", "counts the vowels in a word",
    "finds the largest number in a list", "removes duplicates from a list",
    "returns the factorial of a number", "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome", "sums the numbers from 1 to n",
    "sorts a list of names alphabetically", "counts how often each word appears in a sentence",
    "returns the first n Fibonacci numbers", "merges two dictionaries",
    "reads a text file and prints its lines", "computes the average of a list",
]

TEMPLATES = [
    ("Explain {c} in simple terms.", "c"),
    ("What is {c}?", "c"),
    ("Can you explain how {c} works?", "c"),
    ("Give me a short introduction to {c}.", "c"),
    ("Why is {c} important?", "c"),
    ("Explain {c} to a child.", "c"),
    ("What are the main ideas behind {c}?", "c"),
    ("Give me three tips for {a}.", "a"),
    ("How do I get started with {a}?", "a"),
    ("What are common mistakes when {a}?", "a"),
    ("Make a simple plan for {a}.", "a"),
    ("What are the benefits of {a}?", "a"),
    ("Write a short poem about {t}.", "t"),
    ("Write a haiku about {t}.", "t"),
    ("Describe {t} in a few sentences.", "t"),
    ("Write a short story about {h} who {s}.", "hs"),
    ("Tell me a bedtime story about {h}.", "h"),
    ("List five interesting facts about {n}.", "n"),
    ("How do {n} communicate?", "n"),
    ("What do {n} eat, and where do they live?", "n"),
    ("Give me a simple recipe for {d}.", "d"),
    ("How do I make {d}?", "d"),
    ("What ingredients do I need for {d}?", "d"),
    ("Describe {p} to someone who has never been there.", "p"),
    ("What should I see on a short trip to {p}?", "p"),
    ("Compare {x} and {y}.", "xy"),
    ("What is the difference between {x} and {y}?", "xy"),
    ("Write a polite email to {r} about {u}.", "ru"),
    ("Write a short message to {r} about {u}.", "ru"),
    ("Write a Python function that {k}.", "k"),
    ("Show me how to write a function in Python that {k}, and explain it.", "k"),
]

MATH = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "If I have {a} apples and give away {b}, "
    "how many are left?", "What is {a} percent of {b}?",
]


def make(n, seed):
    rng = random.Random(seed)
    fills = {"c": CONCEPTS, "a": ACTIVITIES, "t": THINGS, "h": CHARACTERS, "s": SITUATIONS,
             "n": ANIMALS, "d": DISHES, "p": PLACES}
    out, seen = [], set()
    held = {json.loads(l) for l in (ROOT / "bench" / "prompts" / "chat50.jsonl").read_text().splitlines()
            if l.strip()}
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        if rng.random() < 0.04:
            a, b = rng.randint(50, 120), rng.randint(2, 45)
            text = rng.choice(MATH).format(a=a, b=b)
        else:
            tmpl, keys = rng.choice(TEMPLATES)
            kw = {}
            for k in keys:
                if k in ("x", "y"):
                    kw["x"], kw["y"] = rng.choice(PAIRS)
                elif k in ("r", "u"):
                    kw["r"], kw["u"] = rng.choice(RECIPIENTS)
                elif k == "k":
                    kw["k"] = rng.choice(CODE_TASKS)
                else:
                    kw[k] = rng.choice(fills[k])
            text = tmpl.format(**kw)
        text = text[0].upper() + text[1:]
        if text in seen or text in held:
            continue
        seen.add(text)
        out.append(text)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default=str(ROOT / "data" / "mtp_prompts.jsonl"))
    args = ap.parse_args()
    prompts = make(args.n, args.seed)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {path}")


if __name__ == "__main__":
    main()
