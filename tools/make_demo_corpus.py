#!/usr/bin/env python
"""Generate the bundled demo corpus: short, grammatical English stories and descriptions.

The text is made procedurally from a seeded generator so the corpus is reproducible and free of
licensing questions. It has a small vocabulary, consistent facts (what each animal eats, where it
lives, how it sounds), correct counting arithmetic and recurring story arcs, so a model of a few
million parameters learns visible structure from it within minutes on a CPU.

    python tools/make_demo_corpus.py                       # rewrites megadlms/assets/demo_corpus.jsonl.gz
    python tools/make_demo_corpus.py --docs 2000 --output /tmp/small.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "megadlms" / "assets" / "demo_corpus.jsonl.gz"

GIRLS = ["Lily", "Mia", "Anna", "Sara", "Emma", "Zoe", "Lucy", "Nora", "Ella", "Ruby", "Grace", "Ivy", "Maya",
         "Rosa", "Hana", "Lena", "Clara", "Alice", "Julia", "Amira", "Nina", "Tara", "Kate", "Olivia", "Sophie",
         "Chloe", "Leah", "Freya", "Isla", "Molly"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Noah", "Finn", "Luke", "Omar", "Theo", "Eli", "Hugo", "Ravi",
        "Oscar", "Milo", "Adam", "Kai", "Jonas", "Felix", "Liam", "Ryan", "Owen", "Ethan", "Pablo", "Dan", "Alex",
        "Marco", "Ivan", "Toby"]


@dataclass(frozen=True)
class Animal:
    name: str
    plural: str
    kind: str  # bird, mammal, fish, insect, reptile, amphibian
    home: str  # "in the forest"
    food: str  # "seeds and berries"
    feature: str  # "long ears"
    sound: str  # past tense, e.g. "barked"
    sound_now: str  # present tense, third person, e.g. "barks"
    size: str  # small / big / tiny / huge
    skill: str  # "hop very fast"


ANIMALS = [
    Animal("dog", "dogs", "mammal", "in houses with people", "meat and biscuits", "a wet nose", "barked", "barks",
           "big", "run and fetch sticks"),
    Animal("cat", "cats", "mammal", "in houses with people", "fish and milk", "soft fur and sharp claws", "meowed",
           "meows", "small", "climb trees"),
    Animal("rabbit", "rabbits", "mammal", "in holes in the ground", "carrots and grass", "long ears", "squeaked",
           "squeaks", "small", "hop very fast"),
    Animal("fox", "foxes", "mammal", "in the forest", "mice and berries", "a bushy tail", "yelped", "yelps",
           "small", "hide in the tall grass"),
    Animal("bear", "bears", "mammal", "in the mountains", "honey and fish", "thick brown fur", "growled", "growls",
           "huge", "catch fish in the river"),
    Animal("owl", "owls", "bird", "in the forest", "mice and bugs", "big round eyes", "hooted", "hoots", "small",
           "see in the dark"),
    Animal("duck", "ducks", "bird", "near ponds and lakes", "seeds and small bugs", "webbed feet", "quacked",
           "quacks", "small", "swim and fly"),
    Animal("frog", "frogs", "amphibian", "near ponds", "flies and bugs", "long sticky tongue", "croaked", "croaks",
           "tiny", "jump very far"),
    Animal("horse", "horses", "mammal", "on farms", "hay and apples", "a long mane", "neighed", "neighs", "big",
           "run very fast"),
    Animal("cow", "cows", "mammal", "on farms", "grass and hay", "a long tail", "mooed", "moos", "big",
           "give milk"),
    Animal("sheep", "sheep", "mammal", "on farms", "grass", "thick white wool", "baaed", "baas", "big",
           "stay warm in the snow"),
    Animal("pig", "pigs", "mammal", "on farms", "corn and apples", "a pink nose", "oinked", "oinks", "big",
           "find food with its nose"),
    Animal("hen", "hens", "bird", "on farms", "corn and seeds", "red feathers", "clucked", "clucks", "small",
           "lay eggs"),
    Animal("mouse", "mice", "mammal", "in small holes", "cheese and seeds", "tiny pink paws", "squeaked", "squeaks",
           "tiny", "squeeze through small gaps"),
    Animal("squirrel", "squirrels", "mammal", "in tall trees", "nuts and seeds", "a fluffy tail", "chattered",
           "chatters", "small", "jump from branch to branch"),
    Animal("bee", "bees", "insect", "in a hive", "nectar from flowers", "yellow and black stripes", "buzzed",
           "buzzes", "tiny", "make honey"),
    Animal("butterfly", "butterflies", "insect", "in gardens and fields", "nectar from flowers", "bright wings",
           "fluttered", "flutters", "tiny", "fly from flower to flower"),
    Animal("turtle", "turtles", "reptile", "near rivers and the sea", "plants and worms", "a hard shell",
           "hissed", "hisses", "small", "hide inside its shell"),
    Animal("fish", "fish", "fish", "in rivers and the sea", "tiny plants and bugs", "shiny scales", "splashed",
           "splashes", "small", "swim very fast"),
    Animal("whale", "whales", "mammal", "in the deep sea", "tiny shrimp", "a huge tail", "sang", "sings", "huge",
           "dive very deep"),
    Animal("dolphin", "dolphins", "mammal", "in the sea", "fish", "a smooth grey body", "clicked", "clicks",
           "big", "jump out of the water"),
    Animal("lion", "lions", "mammal", "on the grassy plains", "meat", "a golden mane", "roared", "roars", "big",
           "run fast for a short time"),
    Animal("elephant", "elephants", "mammal", "on the grassy plains", "grass and leaves", "a long trunk",
           "trumpeted", "trumpets", "huge", "spray water with its trunk"),
    Animal("monkey", "monkeys", "mammal", "in the jungle", "bananas and fruit", "a long tail", "chattered",
           "chatters", "small", "swing from tree to tree"),
    Animal("giraffe", "giraffes", "mammal", "on the grassy plains", "leaves from tall trees", "a very long neck",
           "hummed", "hums", "huge", "reach the highest leaves"),
    Animal("penguin", "penguins", "bird", "on the cold ice", "fish", "black and white feathers", "squawked",
           "squawks", "small", "swim under the ice"),
    Animal("goat", "goats", "mammal", "on rocky hills", "grass and leaves", "little horns", "bleated", "bleats",
           "small", "climb steep rocks"),
    Animal("snail", "snails", "mollusc", "in damp gardens", "leaves", "a curly shell", "hid", "hides", "tiny",
           "carry its house on its back"),
    Animal("parrot", "parrots", "bird", "in the jungle", "seeds and fruit", "bright green feathers", "squawked",
           "squawks", "small", "copy words"),
    Animal("deer", "deer", "mammal", "in the forest", "grass and leaves", "thin legs", "snorted", "snorts", "big",
           "leap over logs"),
    Animal("hedgehog", "hedgehogs", "mammal", "under hedges", "worms and beetles", "sharp spikes", "sniffed",
           "sniffs", "tiny", "roll into a ball"),
    Animal("crab", "crabs", "crustacean", "on the beach", "tiny fish and plants", "two big claws", "clicked",
           "clicks", "small", "walk sideways"),
]

PLACES = ["the park", "the forest", "the beach", "the garden", "the farm", "the lake", "the library", "the zoo",
          "the market", "the river", "the hill", "the meadow", "the school", "the playground", "the village",
          "the old barn", "the bakery", "the museum", "the harbor", "the orchard", "the mountain", "the pond",
          "the field", "the town square", "the toy shop", "the woods", "the big city", "the island", "the cave",
          "the train station"]
OBJECTS = ["ball", "kite", "doll", "book", "hat", "teddy bear", "boat", "bike", "drum", "box", "cup", "shoe",
           "scarf", "map", "key", "bell", "ring", "spoon", "car", "truck", "robot", "puzzle", "crayon", "balloon",
           "blanket", "basket", "flute", "lamp", "shell", "feather", "stone", "umbrella", "backpack", "sock",
           "whistle", "coin", "flag", "bucket", "jar", "ribbon", "clock", "pencil", "apple", "cake", "cookie",
           "sandwich", "flower", "leaf", "star", "ticket"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "white", "black", "brown", "gold",
          "silver", "grey"]
SIZES = ["little", "big", "tiny", "huge", "small", "long", "short", "round"]
GOOD_FEELINGS = ["happy", "glad", "proud", "excited", "calm", "thankful", "cheerful", "joyful"]
BAD_FEELINGS = ["sad", "scared", "worried", "upset", "lonely", "angry", "nervous", "grumpy"]
TRAITS = ["kind", "brave", "curious", "shy", "clever", "funny", "gentle", "friendly", "busy", "careful",
          "cheerful", "quiet", "helpful", "silly", "patient"]
WEATHER = ["sunny", "rainy", "windy", "snowy", "cloudy", "warm", "cold", "foggy", "bright", "stormy"]
TIMES = ["One morning", "One day", "One afternoon", "One evening", "One sunny day", "One rainy day",
         "Early one morning", "Late one afternoon", "On a cold winter day", "On a warm summer day",
         "One spring morning", "One autumn day"]
OPENINGS = ["Once upon a time, there was", "Long ago, there was", "There once was", "In a small village lived",
            "Not long ago, there was", "Far away, there lived"]
RELATIVES = ["mom", "dad", "grandma", "grandpa", "sister", "brother", "aunt", "uncle", "teacher", "neighbor"]
FOODS = ["apples", "bread", "soup", "cookies", "cake", "pancakes", "rice", "carrots", "cheese", "berries",
         "sandwiches", "pie", "noodles", "eggs", "oranges", "grapes", "muffins", "pears"]
GAMES = ["hide and seek", "tag", "catch", "a board game", "a guessing game", "hopscotch", "ball", "pretend",
         "a counting game", "jump rope"]
SKILLS = [("ride a bike", "rode the bike", "rode her bike"), ("swim", "swam across the pool", "swam"),
          ("read", "read a whole page", "read"), ("draw a horse", "drew a horse", "drew"),
          ("tie shoes", "tied the laces", "tied"), ("whistle", "whistled a tune", "whistled"),
          ("bake bread", "baked a warm loaf of bread", "baked"), ("play the flute", "played a song", "played"),
          ("climb the rope", "climbed to the top", "climbed"), ("skate", "skated around the pond", "skated"),
          ("fly a kite", "flew the kite high", "flew"), ("plant seeds", "planted a row of seeds", "planted")]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
COUNTABLE = [("apple", "apples"), ("cookie", "cookies"), ("marble", "marbles"), ("sticker", "stickers"),
             ("pencil", "pencils"), ("shell", "shells"), ("flower", "flowers"), ("balloon", "balloons"),
             ("card", "cards"), ("egg", "eggs"), ("stone", "stones"), ("book", "books"), ("carrot", "carrots"),
             ("cherry", "cherries"), ("button", "buttons"), ("strawberry", "strawberries"), ("toy", "toys")]
MORALS = ["Sharing makes everyone happy.", "It is good to help your friends.", "Being brave is not the same as "
          "never being scared.", "Kind words can make a big difference.", "If you keep trying, you can learn "
          "anything.", "Friends make hard days easier.", "Telling the truth is always the right choice.",
          "It is fun to try new things.", "Saying sorry can fix a lot.", "Patience is a kind of magic.",
          "Small helpers can do big things.", "Everyone is good at something."]

JOBS = ["baker", "farmer", "doctor", "teacher", "painter", "fisher", "builder", "nurse", "pilot", "gardener",
        "driver", "cook", "tailor", "librarian", "mail carrier", "shopkeeper", "vet", "sailor", "singer",
        "firefighter", "clockmaker", "potter", "beekeeper", "carpenter", "astronomer", "juggler", "musician"]
SHOPS = [("bakery", ["loaf of bread", "cake", "muffin", "pie", "bun", "cookie", "tart"]),
         ("toy shop", ["kite", "ball", "doll", "puzzle", "robot", "yo-yo", "toy train"]),
         ("market", ["apple", "pear", "melon", "bag of carrots", "basket of plums", "pumpkin", "lemon"]),
         ("book shop", ["picture book", "story book", "comic", "map", "notebook", "atlas"]),
         ("flower shop", ["rose", "tulip", "sunflower", "daisy", "pot of herbs", "bunch of lilies"]),
         ("sweet shop", ["lollipop", "bag of sweets", "chocolate bar", "candy cane", "jar of jelly beans"])]
TOWN_HEADS = ["Bramble", "Willow", "Oak", "Maple", "Stone", "River", "Hazel", "Clover", "Fern", "Honey", "Mill",
              "Frost", "Amber", "Elder", "Thistle", "Copper", "Lark", "Moss", "Pebble", "Briar", "Apple", "Ash",
              "Birch", "Cherry", "Dove", "Fox", "Glen", "Holly", "Ivy", "Juniper", "Kettle", "Lantern", "Marsh",
              "North", "Orchard", "Pine", "Quill", "Rose", "Salt", "Thorn", "Umber", "Violet", "West", "Yarrow"]
TOWN_TAILS = ["wick", "ford", "by", "ton", "mere", "dale", "brook", "field", "haven", "holt", "moor", "stead",
              "bury", "ridge", "worth", "combe", "well", "gate", "hollow", "wood"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
RECIPES = [("pancakes", ["flour", "milk", "eggs", "butter"], "fry them in a hot pan", "golden"),
           ("banana bread", ["bananas", "flour", "sugar", "eggs"], "bake it in the oven", "soft and brown"),
           ("vegetable soup", ["carrots", "potatoes", "onions", "water"], "cook it in a big pot", "warm and thick"),
           ("apple pie", ["apples", "flour", "butter", "sugar"], "bake it in the oven", "sweet and crisp"),
           ("fruit salad", ["apples", "grapes", "oranges", "berries"], "mix it in a bowl", "fresh and bright"),
           ("rice pudding", ["rice", "milk", "sugar", "cinnamon"], "cook it slowly on the stove", "creamy"),
           ("oat cookies", ["oats", "flour", "butter", "honey"], "bake them on a tray", "chewy"),
           ("tomato pasta", ["pasta", "tomatoes", "garlic", "olive oil"], "boil the pasta and stir in the sauce",
            "rich and red")]
UNITS = [("cup", "cups"), ("spoon", "spoons"), ("bowl", "bowls"), ("handful", "handfuls"), ("pinch", "pinches")]
WHOLE = {"eggs", "bananas", "apples", "potatoes", "onions", "tomatoes", "carrots", "oranges"}
LANDMARKS = ["an old stone bridge", "a tall clock tower", "a windmill", "a lighthouse", "a small castle",
             "a round pond with ducks", "a market square", "a library with a red door", "a quiet harbor",
             "a green park", "a bell tower", "a wooden pier", "an apple orchard", "a busy train station"]
GEOGRAPHY = ["by a wide river", "at the foot of a mountain", "on the edge of a forest", "near the sea",
             "in a green valley", "on a windy hill", "beside a calm lake", "between two hills"]


def a_or_an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def number(n: int) -> str:
    return NUMBERS[n] if 0 <= n < len(NUMBERS) else str(n)


def count(n: int, noun: tuple[str, str]) -> str:
    """'one apple', 'three apples'."""
    return f"{number(n)} {noun[0] if n == 1 else noun[1]}"


@dataclass
class Hero:
    name: str
    she: bool
    desc: str  # "a little girl" / "a small rabbit"
    animal: Animal | None = None

    @property
    def subj(self) -> str:
        return "she" if self.she else "he"

    @property
    def obj(self) -> str:
        return "her" if self.she else "him"

    @property
    def poss(self) -> str:
        return "her" if self.she else "his"


def make_hero(r: random.Random, animal_ok: bool = True) -> Hero:
    she = r.random() < 0.5
    name = r.choice(GIRLS if she else BOYS)
    if animal_ok and r.random() < 0.35:
        animal = r.choice(ANIMALS)
        adj = r.choice([animal.size, r.choice(TRAITS), r.choice(SIZES)])
        return Hero(name, she, a_or_an(f"{adj} {animal.name}"), animal)
    age = r.choice(["little", "young", "small", "curious", "cheerful", "kind"])
    return Hero(name, she, a_or_an(f"{age} {'girl' if she else 'boy'}"))


def make_friend(r: random.Random, hero: Hero) -> Hero:
    while True:
        f = make_hero(r)
        if f.name != hero.name:
            return f


def thing(r: random.Random) -> str:
    obj = r.choice(OBJECTS)
    roll = r.random()
    if roll < 0.45:
        return f"{r.choice(COLORS)} {obj}"
    if roll < 0.7:
        return f"{r.choice(SIZES)} {obj}"
    return obj


def intro(r: random.Random, hero: Hero) -> str:
    trait = r.choice([t for t in TRAITS if t not in hero.desc])
    return (f"{r.choice(OPENINGS)} {hero.desc} named {hero.name}. {cap(hero.subj)} was very {trait} "
            f"and lived near {r.choice(PLACES)}.")


def story_lost(r: random.Random) -> str:
    hero, friend = make_hero(r), make_friend(r, make_hero(r))
    item = thing(r)
    place = r.choice(PLACES)
    spots = r.sample(["under the bed", "behind the door", "in the tall grass", "under a big tree",
                      "next to the bench", "inside an old box", "near the fence", "behind a rock",
                      "under the table", "in the bushes"], 3)
    s = [intro(r, hero),
         f"{cap(hero.subj)} had {a_or_an(item)} that {hero.subj} loved very much.",
         f"{r.choice(TIMES)}, {hero.name} took the {item.split()[-1]} to {place}.",
         f"When it was time to go home, the {item.split()[-1]} was gone!",
         f"{hero.name} felt {r.choice(BAD_FEELINGS)}.",
         f"{cap(hero.subj)} looked {spots[0]} and {spots[1]}, but {hero.subj} could not find it."]
    s.append(f"Then {hero.subj} met {friend.desc} named {friend.name}.")
    s.append(f"\"Why are you {r.choice(BAD_FEELINGS)}?\" asked {friend.name}.")
    s.append(f"\"I lost my {item},\" said {hero.name}.")
    s.append(f"\"I will help you,\" said {friend.name}.")
    s.append(f"Together they looked {spots[2]}, and there it was!")
    s.append(f"{hero.name} was so {r.choice(GOOD_FEELINGS)}. \"Thank you, {friend.name}!\" {hero.subj} said.")
    s.append(f"From that day on, {hero.name} and {friend.name} were best friends.")
    return " ".join(s)


def story_share(r: random.Random) -> str:
    hero, friend = make_hero(r), None
    friend = make_friend(r, hero)
    food = r.choice(FOODS)
    n = r.randint(4, 12)
    give = r.randint(1, n // 2)
    noun = r.choice(COUNTABLE)
    kind = noun[1]
    s = [intro(r, hero),
         f"{r.choice(TIMES)}, {hero.poss} {r.choice(RELATIVES)} gave {hero.obj} {count(n, noun)}."]
    s.append(f"{hero.name} wanted to keep all of them.")
    s.append(f"Then {hero.subj} saw {friend.name}, who looked {r.choice(BAD_FEELINGS)} because {friend.subj} "
             f"had no {kind}.")
    s.append(f"{hero.name} thought for a moment. Then {hero.subj} gave {number(give)} of the {kind} to "
             f"{friend.name}.")
    s.append(f"Now {hero.name} had {number(n - give)} {kind} and {friend.name} had {number(give)}.")
    s.append(f"{friend.name} smiled a big smile. They sat together and ate {food} and played {r.choice(GAMES)}.")
    s.append(f"{hero.name} felt {r.choice(GOOD_FEELINGS)} inside. {r.choice(MORALS[:2])}")
    return " ".join(s)


def story_fear(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    fear = r.choice([("the dark", "the room was dark", "turned on a small lamp"),
                     ("the big dog next door", "the dog barked loudly", "gave the dog a treat"),
                     ("the deep water", "the water looked deep", "held on to the side and kicked"),
                     ("thunder", "thunder boomed in the sky", "counted slowly between the flashes"),
                     ("the tall slide", "the slide looked very high", "climbed up one step at a time"),
                     ("the first day of school", "there were many new faces", "said hello to one girl"),
                     ("spiders", "a spider was on the wall", "watched it spin a web")])
    helper = r.choice(RELATIVES)
    s = [intro(r, hero),
         f"{hero.name} was afraid of {fear[0]}.",
         f"{r.choice(TIMES)}, {fear[1]}, and {hero.name} felt {r.choice(['scared', 'nervous', 'worried'])}.",
         f"{cap(hero.poss)} {helper} came and sat next to {hero.obj}.",
         f"\"It is okay to be scared,\" said {hero.poss} {helper}. \"Let us be brave together.\"",
         f"{hero.name} took a deep breath and {fear[2]}.",
         f"After a while, {hero.subj} was not scared anymore.",
         f"{hero.name} felt {r.choice(['proud', 'brave', 'happy', 'calm'])}. {MORALS[2]}"]
    return " ".join(s)


def story_learn(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    skill, success, _ = r.choice(SKILLS)
    tries = r.randint(2, 5)
    helper = r.choice(RELATIVES)
    s = [intro(r, hero),
         f"{hero.name} wanted to learn to {skill}.",
         f"The first time {hero.subj} tried, it was hard, and {hero.subj} felt {r.choice(BAD_FEELINGS)}.",
         f"{cap(hero.poss)} {helper} said, \"Try again. Go slowly.\""]
    for i in range(2, tries + 1):
        if i < tries:
            s.append(f"{hero.name} tried {r.choice(['again', 'once more', 'one more time'])}, but it was still "
                     f"{r.choice(['hard', 'tricky', 'not easy'])}.")
        else:
            s.append(f"On the {['', 'first', 'second', 'third', 'fourth', 'fifth'][i]} try, {hero.name} {success}!")
    s.append(f"{hero.name} was very {r.choice(GOOD_FEELINGS)}. {cap(hero.poss)} {helper} clapped and cheered.")
    s.append(MORALS[4])
    return " ".join(s)


def story_weather(r: random.Random) -> str:
    hero, friend = make_hero(r), None
    friend = make_friend(r, hero)
    plan = r.choice(GAMES)
    place = r.choice(PLACES)
    bad = r.choice(["rainy", "stormy", "windy", "snowy", "cold"])
    indoor = r.choice(["built a fort out of blankets", "baked cookies", "read a book together",
                       "drew pictures of animals", "made a puppet show", "played a board game"])
    s = [intro(r, hero),
         f"{hero.name} and {hero.poss} friend {friend.name} wanted to play {plan} at {place}.",
         f"But when they looked outside, the day was {bad}.",
         f"\"Oh no,\" said {friend.name}. \"We cannot go to {place} today.\"",
         f"{hero.name} had an idea. \"Let us stay inside and have fun here.\"",
         f"So they {indoor}.",
         f"The next day was {r.choice(['sunny', 'warm', 'bright'])}, and they played {plan} at {place} "
         "after all.",
         f"{hero.name} learned that a {bad} day can still be a good day."]
    return " ".join(s)


def story_help(r: random.Random) -> str:
    hero = make_hero(r)
    who = r.choice(ANIMALS)
    problem = r.choice([("was stuck in a tree", "climbed up carefully and helped it down"),
                        ("had a thorn in its paw", "gently pulled the thorn out"),
                        ("was lost and far from home", f"walked with it back to its home {who.home}"),
                        ("was hungry and tired", f"shared some {who.food} with it"),
                        ("was caught in a net", "untied the net very slowly"),
                        ("could not find its family", "helped it call until its family came")])
    s = [intro(r, hero),
         f"{r.choice(TIMES)}, {hero.name} went for a walk to {r.choice(PLACES)}.",
         f"On the way, {hero.subj} heard a sound. It was {a_or_an(who.size + ' ' + who.name)}!",
         f"The {who.name} {problem[0]}.",
         f"{hero.name} was {r.choice(['kind', 'brave', 'gentle', 'careful'])}, so {hero.subj} {problem[1]}.",
         f"The {who.name} {who.sound} with joy.",
         f"After that, the {who.name} visited {hero.name} every day.",
         MORALS[r.choice([1, 10, 3])]]
    return " ".join(s)


def story_count(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    friend = make_friend(r, hero)
    noun = r.choice(COUNTABLE)
    a = r.randint(1, 6)
    b = r.randint(1, 6)
    lose = r.randint(1, a + b - 1)
    s = [f"{hero.name} had {count(a, noun)}.",
         f"{friend.name} gave {hero.obj} {number(b)} more {noun[0] if b == 1 else noun[1]}.",
         f"Now {hero.name} had {count(a + b, noun)}.",
         f"Then {hero.subj} gave {count(lose, noun)} to {hero.poss} {r.choice(RELATIVES)}.",
         f"So {hero.name} had {count(a + b - lose, noun)} left.",
         f"{number(a).capitalize()} plus {number(b)} is {number(a + b)}, and {number(a + b)} take away "
         f"{number(lose)} is {number(a + b - lose)}."]
    return " ".join(s)


def describe_animal(r: random.Random) -> str:
    x = r.choice(ANIMALS)
    art = a_or_an(x.name)
    kind = {"amphibian": "an amphibian", "insect": "an insect", "mollusc": "a mollusc",
            "crustacean": "a crustacean", "fish": "an animal that lives in water"}.get(x.kind, a_or_an(x.kind))
    s = [f"{cap(art)} is {kind}.",
         f"{cap(x.plural)} live {x.home}.",
         f"They eat {x.food}.",
         f"{cap(art)} has {x.feature}.",
         f"{cap(art)} can {x.skill}.",
         f"When {art} is happy, it {x.sound_now}."]
    r.shuffle(s[1:5])
    if r.random() < 0.5:
        other = r.choice([a for a in ANIMALS if a.home != x.home])
        s.append(f"{cap(x.plural)} do not live {other.home}. {cap(other.plural)} live there.")
    return " ".join(s)


def describe_day(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    weather = r.choice(WEATHER)
    places = r.sample(PLACES, 3)
    food = r.choice(FOODS)
    s = [f"Today was a {weather} day.",
         f"In the morning, {hero.name} ate {food} for breakfast.",
         f"Then {hero.subj} went to {places[0]} with {hero.poss} {r.choice(RELATIVES)}.",
         f"At {places[0]}, they saw {a_or_an(r.choice(ANIMALS).name)} and {a_or_an(thing(r))}.",
         f"After lunch, {hero.name} played {r.choice(GAMES)} at {places[1]}.",
         f"In the evening, {hero.subj} read a book about {r.choice(ANIMALS).plural}.",
         f"{hero.name} went to bed feeling {r.choice(GOOD_FEELINGS)}."]
    return " ".join(s)


def story_friends(r: random.Random) -> str:
    a = make_hero(r)
    b = make_friend(r, a)
    x = thing(r)
    s = [f"{a.name} and {b.name} were friends.",
         f"{r.choice(TIMES)}, they both wanted to play with the same {x}.",
         f"\"It is mine!\" said {a.name}. \"No, it is mine!\" said {b.name}.",
         f"They pulled and pulled, and the {x.split()[-1]} fell into the mud.",
         f"Both friends felt {r.choice(BAD_FEELINGS)}.",
         f"\"I am sorry,\" said {a.name}. \"I am sorry too,\" said {b.name}.",
         f"They washed the {x.split()[-1]} together and took turns playing with it.",
         MORALS[8]]
    return " ".join(s)


def town_name(r: random.Random) -> str:
    return r.choice(TOWN_HEADS) + r.choice(TOWN_TAILS)


def ordinal(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_town(r: random.Random) -> str:
    town = town_name(r)
    people = r.randrange(200, 9000, 10)
    year = r.randint(1100, 1950)
    marks = r.sample(LANDMARKS, 3)
    job = r.choice(JOBS)
    s = [f"{town} is a small town {r.choice(GEOGRAPHY)}.",
         f"About {people} people live in {town}.",
         f"The town was built in the year {year}, so it is very old.",
         f"In {town} you can see {marks[0]}, {marks[1]} and {marks[2]}.",
         f"The most famous person in {town} is the {job}, who is known for being {r.choice(TRAITS)}.",
         f"Every {r.choice(MONTHS)}, the people of {town} have a big fair with music and {r.choice(FOODS)}."]
    if r.random() < 0.5:
        other = town_name(r)
        if other != town:
            km = r.randint(2, 60)
            s.append(f"The next town, {other}, is {km} kilometers away. It takes about {km * 12} minutes to walk "
                     "there.")
    return " ".join(s)


def story_shop(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    shop, items = r.choice(SHOPS)
    item = r.choice(items)
    money = r.randint(5, 30)
    price = r.randint(2, money)
    town = town_name(r)
    s = [f"{hero.name} lived in {town}.",
         f"{r.choice(TIMES)}, {hero.subj} went to the {shop} with {money} coins in {hero.poss} pocket.",
         f"{cap(hero.subj)} wanted to buy {a_or_an(item)}.",
         f"\"How much is the {item}?\" asked {hero.name}.",
         f"\"It costs {price} coins,\" said the {r.choice(['shopkeeper', 'old man', 'kind woman', 'baker'])}."]
    s.append(f"{hero.name} paid {price} coins and had {money - price} coins left.")
    if money - price >= 2 and r.random() < 0.5:
        s.append(f"With the rest, {hero.subj} bought a small gift for {hero.poss} {r.choice(RELATIVES)}.")
    s.append(f"{hero.name} walked home feeling {r.choice(GOOD_FEELINGS)}.")
    return " ".join(s)


def diary(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    day = r.randint(1, 28)
    month = r.choice(MONTHS)
    weather = r.choice(WEATHER)
    friend = make_friend(r, hero)
    hour = r.randint(7, 11)
    s = [f"Dear diary, today is {r.choice(WEEKDAYS)}, the {ordinal(day)} of {month}.",
         f"The weather was {weather}.",
         f"I woke up at {hour} o'clock and had {r.choice(FOODS)} for breakfast.",
         f"Then I met {friend.name} at {r.choice(PLACES)}, and we played {r.choice(GAMES)}.",
         f"We saw {a_or_an(r.choice(ANIMALS).name)} and {number(r.randint(2, 9))} "
         f"{r.choice(ANIMALS).plural}.",
         f"At {r.randint(3, 8)} o'clock in the afternoon I went home. Tomorrow I want to visit the "
         f"{r.choice(JOBS)}.",
         f"Love, {hero.name}"]
    return "\n".join(s)


def recipe(r: random.Random) -> str:
    name, parts, method, result = r.choice(RECIPES)
    amounts = [f"{r.randint(2, 6)} {p}" if p in WHOLE else f"{count(r.randint(1, 4), r.choice(UNITS))} of {p}"
               for p in parts]
    people = r.randint(2, 8)
    minutes = r.randrange(10, 65, 5)
    s = [f"How to make {name} for {people} people.",
         f"You need {', '.join(amounts[:-1])} and {amounts[-1]}.",
         f"First, wash your hands. Then put the {parts[0]} and the {parts[1]} in a bowl.",
         f"Add the {parts[2]} and the {parts[3]}, and mix well.",
         f"Now {method}. This takes about {minutes} minutes.",
         f"When it is {result}, it is ready. Share it with {number(people - 1)} friends and enjoy!"]
    return " ".join(s)


def story_job(r: random.Random) -> str:
    hero = make_hero(r, animal_ok=False)
    job = r.choice(JOBS)
    town = town_name(r)
    hours = r.randint(3, 10)
    s = [f"In the town of {town} there was {a_or_an(job)} named {hero.name}.",
         f"Every morning, {hero.name} got up at {r.randint(4, 8)} o'clock and went to work.",
         f"{cap(hero.subj)} worked for {hours} hours each day and was always {r.choice(TRAITS)}.",
         f"{r.choice(TIMES)}, a child asked, \"Why do you like being {a_or_an(job)}?\"",
         f"{hero.name} smiled and said, \"Because I can help the people of {town}.\"",
         f"The child thought about it and decided to become {a_or_an(job)} one day too."]
    return " ".join(s)


KINDS = [(story_lost, 3), (story_share, 2), (story_fear, 2), (story_learn, 2), (story_weather, 2),
         (story_help, 2), (story_count, 2), (describe_animal, 2), (describe_day, 2), (story_friends, 2),
         (describe_town, 2), (story_shop, 2), (diary, 1), (recipe, 1), (story_job, 2)]


def make_document(r: random.Random) -> str:
    """One document: one to three short texts joined by blank-line paragraph breaks."""
    fns, weights = zip(*KINDS)
    k = r.choices([1, 2, 3], weights=[6, 3, 1])[0]
    return "\n\n".join(r.choices(fns, weights=weights)[0](r) for _ in range(k))


def generate(num_docs: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [make_document(r) for _ in range(num_docs)]


def write_jsonl_gz(texts: list[str], path: Path) -> None:
    """Write `{"text": ...}` lines, gzip with a fixed mtime so the bytes are reproducible."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        for t in texts:
            gz.write((json.dumps({"text": t}, ensure_ascii=False) + "\n").encode("utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=20000, help="number of documents")
    p.add_argument("--seed", type=int, default=20251202)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    a = p.parse_args()
    texts = generate(a.docs, a.seed)
    write_jsonl_gz(texts, a.output)
    raw = sum(len(t.encode()) for t in texts)
    print(f"wrote {a.output}: {len(texts)} documents, {raw / 1e6:.1f} MB of text, "
          f"{a.output.stat().st_size / 1e6:.2f} MB compressed")


if __name__ == "__main__":
    main()
