"""Write jfcore/data/builtin_prompts.jsonl (a tool, not library code): the project's own short coding and math questions.

Everything here was written for this project (not taken from any dataset or
benchmark). Coding tasks are hand-written (function name, signature, what it
does) and rendered with a few phrasings; math questions come from ~60 templates
filled with small numbers from a fixed seed, plus hand-written ones. The output
is deterministic: re-running this script reproduces the committed file.

    python tools/make_builtin_prompts.py [--check-against ../shared/data/eval]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "jfcore" / "data" / "builtin_prompts.jsonl"

# (signature, what it does: a clause that follows "that ...")
FUNCTIONS = [
    ("count_vowels(s)", "returns the number of vowels (a, e, i, o, u, either case) in the string s"),
    ("reverse_words(sentence)", "returns the sentence with the order of its words reversed"),
    ("is_palindrome(s)", "returns True if s reads the same forwards and backwards, ignoring case and spaces"),
    ("capitalize_words(text)", "returns text with the first letter of every word in upper case"),
    ("char_frequency(s)", "returns a dict mapping each character of s to how many times it occurs"),
    ("remove_duplicates(items)", "returns a new list with duplicates removed, keeping the first occurrence order"),
    ("flatten(nested)", "flattens a list of lists of any depth into a single flat list"),
    (
        "second_largest(numbers)",
        "returns the second largest distinct value in a list of numbers, or None if there is none",
    ),
    ("factorial(n)", "returns n! for a non-negative integer n, computed recursively"),
    ("fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1"),
    ("is_prime(n)", "returns True if the integer n is a prime number"),
    ("primes_up_to(n)", "returns a list of all primes less than or equal to n using the sieve of Eratosthenes"),
    ("gcd(a, b)", "returns the greatest common divisor of two positive integers using Euclid's algorithm"),
    ("lcm(a, b)", "returns the least common multiple of two positive integers"),
    ("sum_of_digits(n)", "returns the sum of the decimal digits of a non-negative integer n"),
    ("digital_root(n)", "repeatedly sums the digits of n until a single digit remains and returns it"),
    ("binary_search(items, target)", "returns the index of target in the sorted list items, or -1 if it is absent"),
    ("merge_sorted(a, b)", "merges two sorted lists into one sorted list without calling sort"),
    ("bubble_sort(items)", "returns a sorted copy of items using bubble sort"),
    ("insertion_sort(items)", "sorts the list items in place using insertion sort and returns it"),
    ("merge_sort(items)", "returns a sorted copy of items using recursive merge sort"),
    ("quick_sort(items)", "returns a sorted copy of items using quicksort with the first element as pivot"),
    ("chunk(items, size)", "splits items into consecutive lists of length size (the last one may be shorter)"),
    ("rotate_left(items, k)", "returns the list rotated left by k positions"),
    ("invert_dict(d)", "returns a new dict with keys and values swapped, assuming the values are unique"),
    ("merge_dicts(a, b)", "returns a new dict with the keys of both dicts, adding the values of keys present in both"),
    ("word_count(text)", "returns a dict mapping each lower-cased word in text to its number of occurrences"),
    ("most_common_char(s)", "returns the character that appears most often in s (the earliest one on ties)"),
    ("is_anagram(a, b)", "returns True if the two strings are anagrams of each other, ignoring spaces and case"),
    ("group_anagrams(words)", "groups a list of words into lists of anagrams and returns the groups"),
    (
        "caesar_shift(text, k)",
        "shifts every letter of text by k places in the alphabet, keeping case and leaving other characters alone",
    ),
    ("run_length_encode(s)", "compresses s with run-length encoding, so 'aaabcc' becomes 'a3b1c2'"),
    ("run_length_decode(s)", "reverses run-length encoding, so 'a3b1c2' becomes 'aaabcc'"),
    ("is_balanced(s)", "returns True if the brackets (), [] and {} in s are balanced and properly nested"),
    ("to_snake_case(name)", "converts a CamelCase identifier such as 'HttpServerError' to 'http_server_error'"),
    ("to_camel_case(name)", "converts a snake_case identifier such as 'max_token_count' to 'maxTokenCount'"),
    ("count_words(sentence)", "returns the number of words in a sentence, treating runs of spaces as one separator"),
    ("longest_word(sentence)", "returns the longest word in a sentence (the first one on ties)"),
    ("title_length(title)", "returns the number of characters in title after stripping leading and trailing spaces"),
    ("pairwise_sums(a, b)", "returns a list whose i-th element is a[i] + b[i] for two lists of equal length"),
    ("running_total(numbers)", "returns the list of cumulative sums of numbers"),
    ("moving_average(values, window)", "returns the averages of every consecutive run of window values"),
    (
        "max_subarray_sum(numbers)",
        "returns the largest sum of a contiguous non-empty slice of numbers (Kadane's algorithm)",
    ),
    ("two_sum(numbers, target)", "returns the indices of two different elements that add up to target, or None"),
    ("missing_number(numbers)", "returns the one number missing from a list holding 0..n with exactly one gap"),
    ("count_evens(numbers)", "returns how many even integers the list contains"),
    ("filter_positive(numbers)", "returns only the strictly positive numbers of the list, in order"),
    ("squares(n)", "returns the list of the squares of 1 through n"),
    ("power_set(items)", "returns a list of all subsets of the list items"),
    ("permutations(s)", "returns all permutations of the characters of s as a list of strings, computed recursively"),
    ("binary_to_int(bits)", "converts a string of 0s and 1s to the integer it represents without using int(bits, 2)"),
    (
        "int_to_binary(n)",
        "returns the binary representation of a non-negative integer n as a string without using bin()",
    ),
    ("roman_to_int(s)", "converts a Roman numeral string such as 'XIV' to an integer"),
    ("int_to_roman(n)", "converts an integer between 1 and 3999 to a Roman numeral string"),
    ("celsius_to_fahrenheit(c)", "converts a temperature in degrees Celsius to degrees Fahrenheit"),
    ("seconds_to_hms(seconds)", "formats a number of seconds as an 'H:MM:SS' string"),
    ("is_leap_year(year)", "returns True if year is a leap year in the Gregorian calendar"),
    ("days_in_month(month, year)", "returns the number of days in the given month of the given year"),
    ("transpose(matrix)", "returns the transpose of a matrix given as a list of equal-length rows"),
    ("matrix_multiply(a, b)", "multiplies two matrices given as lists of rows and returns the product"),
    ("identity_matrix(n)", "returns the n-by-n identity matrix as a list of lists"),
    ("diagonal_sum(matrix)", "returns the sum of the main diagonal of a square matrix"),
    ("spiral_order(matrix)", "returns the elements of a matrix in clockwise spiral order starting at the top left"),
    ("count_islands(grid)", "counts groups of horizontally or vertically connected 1s in a grid of 0s and 1s"),
    ("depth(tree)", "returns the depth of a tree given as nested dicts with a 'children' list"),
    (
        "tree_sum(tree)",
        "returns the sum of the 'value' fields of every node in a tree of nested dicts with 'children' lists",
    ),
    ("hanoi_moves(n)", "returns the list of (from_peg, to_peg) moves that solve the Tower of Hanoi with n disks"),
    ("power(base, exp)", "computes base ** exp for a non-negative integer exp by repeated squaring"),
    ("integer_sqrt(n)", "returns the largest integer whose square is at most n, using binary search"),
    ("collatz_steps(n)", "returns how many steps the Collatz process takes to reach 1 from n"),
    ("is_perfect_number(n)", "returns True if n equals the sum of its proper divisors"),
    ("divisors(n)", "returns the sorted list of all positive divisors of n"),
    ("prime_factors(n)", "returns the prime factors of n in ascending order, with repetition"),
    ("is_armstrong(n)", "returns True if n equals the sum of its digits each raised to the number of digits"),
    ("reverse_integer(n)", "returns the integer formed by reversing the digits of n, keeping its sign"),
    ("count_substring(text, sub)", "counts possibly overlapping occurrences of sub in text"),
    ("find_all(text, sub)", "returns the list of every index where sub starts in text"),
    ("strip_punctuation(text)", "returns text with all punctuation characters removed"),
    ("is_pangram(sentence)", "returns True if the sentence uses every letter of the English alphabet at least once"),
    ("first_unique_char(s)", "returns the index of the first character of s that occurs only once, or -1"),
    ("longest_common_prefix(words)", "returns the longest prefix shared by every string in the list words"),
    ("compress_spaces(text)", "replaces every run of whitespace in text with a single space"),
    (
        "mask_email(email)",
        "keeps the first letter of the name part of an email address and replaces the rest of it with '*'",
    ),
    (
        "validate_password(pw)",
        "returns True if pw has at least 8 characters, a digit, an upper-case and a lower-case letter",
    ),
    ("parse_key_values(text)", "parses a string like 'a=1;b=2' into the dict {'a': '1', 'b': '2'}"),
    ("format_table(rows)", "returns a string with one line per row and the columns separated by ' | '"),
    ("sort_by_length(words)", "returns the words sorted by length, keeping alphabetical order for equal lengths"),
    ("sort_dict_by_value(d)", "returns the (key, value) pairs of d sorted by value in descending order"),
    ("top_k(numbers, k)", "returns the k largest numbers of the list in descending order"),
    ("kth_smallest(numbers, k)", "returns the k-th smallest element of the list (k starts at 1)"),
    ("median(numbers)", "returns the median of a non-empty list of numbers"),
    ("mode(numbers)", "returns the value that occurs most often in a non-empty list (the smallest one on ties)"),
    ("variance(numbers)", "returns the population variance of a list of numbers"),
    ("normalize(values)", "rescales a list of numbers linearly so the smallest becomes 0 and the largest becomes 1"),
    ("dot_product(a, b)", "returns the dot product of two equal-length lists of numbers"),
    ("vector_length(v)", "returns the Euclidean length of a vector given as a list of numbers"),
    ("interleave(a, b)", "returns a list alternating elements of a and b, appending the rest of the longer one"),
    ("zip_to_dict(keys, values)", "builds a dict from a list of keys and a list of values of the same length"),
    ("unique_sorted(items)", "returns the distinct elements of items in ascending order"),
    (
        "intersection(a, b)",
        "returns the elements common to both lists, without duplicates, in the order they appear in a",
    ),
    ("symmetric_difference(a, b)", "returns the sorted elements that are in exactly one of the two lists"),
    ("all_equal(items)", "returns True if every element of the list is equal to the first one"),
    ("is_sorted(items)", "returns True if the list is in non-decreasing order"),
    ("index_of_max(numbers)", "returns the index of the largest number in a non-empty list"),
    ("replace_negatives(numbers)", "returns a copy of the list with every negative number replaced by 0"),
    ("every_nth(items, n)", "returns every n-th element of items, starting with the first one"),
    (
        "split_even_odd(numbers)",
        "returns a pair of lists: the even numbers and the odd numbers, each in the original order",
    ),
    ("count_in_range(numbers, low, high)", "counts the numbers that lie between low and high inclusive"),
    (
        "nested_get(d, keys)",
        "follows a list of keys into nested dicts and returns the value found, or None if a key is missing",
    ),
    ("deep_count(d)", "counts all keys in a dict, including the keys of dicts nested inside it"),
    (
        "group_by_first_letter(words)",
        "returns a dict mapping each first letter to the list of words that start with it",
    ),
    ("histogram(numbers)", "returns a string with one line of '*' characters per number, as many as its value"),
    ("triangle(n)", "returns a list of n strings forming a right triangle of '#' characters, one more on each line"),
    ("fizzbuzz(n)", "returns the FizzBuzz strings for 1 through n as a list"),
    ("pascal_row(n)", "returns row n of Pascal's triangle, where row 0 is [1]"),
    ("binomial(n, k)", "returns the number of ways to choose k items from n without using math.comb"),
    (
        "count_paths(rows, cols)",
        "returns the number of paths from the top-left to the bottom-right of a grid moving only right or down",
    ),
    ("climb_stairs(n)", "returns how many ways there are to climb n steps taking 1 or 2 steps at a time"),
    (
        "coin_change(coins, amount)",
        "returns the fewest coins from the list coins that add up to amount, or -1 if impossible",
    ),
    (
        "longest_increasing_run(numbers)",
        "returns the length of the longest run of strictly increasing consecutive numbers",
    ),
    ("edit_distance(a, b)", "returns the Levenshtein distance between the strings a and b"),
    ("longest_common_subsequence(a, b)", "returns the length of the longest common subsequence of the strings a and b"),
    ("is_subsequence(small, big)", "returns True if the characters of small appear in big in the same order"),
    ("knapsack(weights, values, capacity)", "returns the best total value of a 0/1 knapsack with the given capacity"),
    (
        "bfs_order(graph, start)",
        "returns the nodes of a graph (a dict of adjacency lists) in breadth-first order from start",
    ),
    ("has_cycle(graph)", "returns True if the directed graph given as a dict of adjacency lists contains a cycle"),
    (
        "shortest_path_length(graph, a, b)",
        "returns the number of edges on a shortest path from a to b in an unweighted graph, or -1",
    ),
    (
        "topological_sort(graph)",
        "returns a topological order of a directed acyclic graph given as a dict of adjacency lists",
    ),
    ("safe_divide(a, b)", "returns a / b, or None when b is zero"),
    ("clamp(x, low, high)", "returns x limited to the range from low to high"),
    ("round_to_nearest(x, step)", "rounds the number x to the nearest multiple of step"),
    ("percent_change(old, new)", "returns the percentage change from old to new, rounded to two decimals"),
    (
        "average_grade(grades)",
        "takes a dict mapping student names to lists of scores and returns a dict of their averages",
    ),
    ("cheapest_item(prices)", "returns the name of the cheapest item in a dict mapping item names to prices"),
    (
        "total_cost(cart, prices)",
        "returns the total cost of a cart given as a dict of item counts, using a dict of unit prices",
    ),
    ("vowel_positions(word)", "returns the list of indices at which word has a vowel"),
    ("alternate_case(s)", "returns s with letters alternating between upper and lower case, starting with upper case"),
    ("acronym(phrase)", "returns the upper-case first letters of the words of phrase joined together"),
    (
        "pig_latin(word)",
        "translates a lower-case word to Pig Latin by moving leading consonants to the end and adding 'ay'",
    ),
    ("count_uppercase(s)", "returns how many upper-case letters s contains"),
    ("extract_digits(s)", "returns a string made of only the digit characters of s, in order"),
    ("sum_numbers_in_text(text)", "returns the sum of all whole numbers that appear in text"),
    ("wrap_text(text, width)", "splits text into lines of at most width characters without breaking words"),
    ("center_text(text, width)", "pads text with spaces on both sides so it is centered in a field of the given width"),
    ("is_valid_ipv4(address)", "returns True if address is four dot-separated numbers from 0 to 255"),
    ("hex_to_rgb(color)", "converts a color string like '#1a2b3c' to a tuple of three integers"),
    ("dedent_lines(lines)", "removes the longest common leading whitespace from a list of lines"),
    (
        "nth_word(sentence, n)",
        "returns the n-th word of sentence (starting at 1), or an empty string if there are fewer words",
    ),
    (
        "same_digits(a, b)",
        "returns True if the two non-negative integers use exactly the same digits the same number of times",
    ),
    ("next_palindrome(n)", "returns the smallest palindromic integer greater than n"),
    ("triangular(n)", "returns the n-th triangular number 1 + 2 + ... + n"),
    ("sum_of_squares(n)", "returns 1**2 + 2**2 + ... + n**2"),
    ("count_bits(n)", "returns the number of 1 bits in the binary form of a non-negative integer"),
    ("flip_bits(n, width)", "returns n with its lowest width bits inverted"),
    ("make_change(amount)", "returns a dict of how many 25, 10, 5 and 1 cent coins make amount with the fewest coins"),
    ("schedule_overlap(a, b)", "returns True if two (start, end) time intervals overlap"),
    ("count_consonants(word)", "returns how many letters of word are consonants"),
    ("remove_vowels(s)", "returns s with every vowel removed"),
    ("swap_case(s)", "returns s with upper-case letters made lower case and lower-case letters made upper case"),
    ("repeat_each(s, k)", "returns a string in which every character of s is repeated k times"),
    ("is_rotation(a, b)", "returns True if the string b is a rotation of the string a, like 'lohel' of 'hello'"),
    ("longest_palindrome(s)", "returns the longest substring of s that is a palindrome"),
    ("word_lengths(sentence)", "returns a list with the length of each word of sentence"),
    ("censor(text, banned)", "replaces every word of text that is in the set banned with asterisks of the same length"),
    ("last_index(items, value)", "returns the index of the last occurrence of value in items, or -1"),
    ("product(numbers)", "returns the product of all numbers in the list (1 for an empty list)"),
    ("cumulative_max(numbers)", "returns a list whose i-th element is the largest of the first i + 1 numbers"),
    (
        "pairs_with_sum(numbers, target)",
        "returns every pair (a, b) with a <= b from the list whose sum is target, without repeats",
    ),
    ("count_distinct(items)", "returns the number of different values in items"),
    ("duplicates(items)", "returns the sorted list of values that occur more than once in items"),
    (
        "partition(items, predicate)",
        "returns two lists: the items for which predicate is true and those for which it is false",
    ),
    ("window_max(numbers, k)", "returns the maximum of every window of k consecutive numbers"),
    ("count_leaves(tree)", "counts the nodes with no children in a tree of nested dicts with 'children' lists"),
    (
        "path_exists(grid)",
        "returns True if a path of 0 cells connects the top-left and bottom-right corners of a grid of 0s and 1s",
    ),
    ("sum_nested(items)", "returns the sum of all numbers in a list that may contain lists nested to any depth"),
    ("count_occurrences(items, value)", "counts how many times value appears in a nested list, searching recursively"),
    ("ackermann(m, n)", "computes the Ackermann function for small non-negative m and n recursively"),
    ("gray_code(n)", "returns the list of n-bit Gray codes as integers, starting with 0"),
    ("is_power_of_two(n)", "returns True if the positive integer n is a power of two"),
    ("digits_to_words(n)", "spells out each digit of a non-negative integer, so 407 becomes 'four zero seven'"),
    ("ordinal(n)", "returns n with its English ordinal suffix, such as '1st', '2nd', '3rd', '11th' or '22nd'"),
    (
        "age_in_days(years)",
        "returns an approximate number of days lived for a whole number of years, counting 365 days a year",
    ),
    ("bmi(weight_kg, height_m)", "returns the body mass index weight / height**2 rounded to one decimal"),
    ("merge_intervals(intervals)", "merges overlapping (start, end) intervals and returns them sorted by start"),
]

# Tasks that do not fit the "function that ..." mold.
FREE_CODE = [
    "Write a Python class `Stack` with `push`, `pop`, `peek` and `is_empty` methods, backed by a list.",
    "Write a Python class `Queue` using two stacks, with `enqueue` and `dequeue` methods.",
    "Write a Python class `Counter` whose `increment()` method adds one and whose `value` property returns the count.",
    "Write a Python class `Rectangle` with `width` and `height` attributes and methods `area()` and `perimeter()`.",
    "Write a Python class `BankAccount` with `deposit` and `withdraw` methods; withdrawing more than the balance raises ValueError.",
    "Write a Python class `LRUCache` with a fixed capacity and `get` and `put` methods that evict the least recently used key.",
    "Write a Python generator `countdown(n)` that yields n, n - 1, ..., 1.",
    "Write a Python generator `evens()` that yields the even numbers 0, 2, 4, ... forever.",
    "Write a Python decorator `call_counter` that records in `func.calls` how many times the decorated function was called.",
    "Write a Python context manager `timer()` that prints how many seconds the block inside it took.",
    "Write a Python function that reads a text file and returns the number of non-empty lines in it.",
    "Write a Python script that prints the multiplication table from 1 x 1 to 9 x 9, one row per line.",
    "Write a Python list comprehension that builds the list of squares of the odd numbers below 20.",
    "Write a Python dict comprehension that maps each word of a list to its length.",
    "Explain what this Python expression returns and why: `[x * 2 for x in range(5) if x % 2]`.",
    "What does `sorted(['b', 'A', 'c'], key=str.lower)` return in Python?",
    "Fix the bug in this Python function: `def average(xs): return sum(xs) / len(xs) + 1`.",
    "Rewrite this Python loop as a single list comprehension: `out = []` then `for w in words: out.append(w.upper())`.",
    "Write a Python function that returns True if a singly linked list, given by its head node with a `next` attribute, has a cycle.",
    "Write a Python class `Node` for a binary search tree with an `insert(value)` method and a `contains(value)` method.",
    "Write a recursive Python function that returns the in-order traversal of a binary tree whose nodes have `left`, `right` and `value`.",
    "Write a Python function that returns the height of a binary tree whose nodes have `left` and `right` attributes.",
    "Write a Python function that checks whether a 9x9 Sudoku grid, given as a list of lists, has no repeated digit in any row.",
    "Write a Python function that plays one round of rock-paper-scissors: given two moves, return 'first', 'second' or 'draw'.",
    "Write a Python function that converts a list of (name, age) tuples into a dict and returns the name of the oldest person.",
]

CODE_PHRASINGS = [
    "Write a Python function `{sig}` that {what}.",
    "Implement `{sig}` in Python so that it {what}.",
    "Define a Python function `{sig}` that {what}.",
    "Write `{sig}` in Python: a function that {what}.",
    "Create a Python function named `{sig}` that {what}.",
]

NAMES = [
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Leo",
    "Mina",
    "Nora",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
    "Zoe",
]
THINGS = ["marbles", "stickers", "pencils", "apples", "stamps", "cards", "shells", "beads", "books", "coins"]


def _math_templates(rng: random.Random) -> list:
    """Each entry: a function of the random generator that returns one question."""
    r, name, thing = rng.randint, (lambda: rng.choice(NAMES)), (lambda: rng.choice(THINGS))

    def linear():
        x, a, b = r(2, 12), r(2, 9), r(1, 30)
        return f"Solve for x: {a}x + {b} = {a * x + b}."

    def linear_minus():
        x, a, b = r(3, 15), r(2, 8), r(1, 20)
        return f"Solve for x: {a}x - {b} = {a * x - b}."

    def bracket():
        x, a, b = r(4, 15), r(2, 6), r(1, 3)
        return f"Solve for x: {a}(x - {b}) = {a * (x - b)}."

    def both_sides():
        x, a, c, b = r(1, 10), r(4, 9), r(1, 3), r(1, 10)
        d = (a - c) * x + b
        return f"Solve for y: {a}y + {b} = {c}y + {d}."

    def divide_eq():
        a, q, b = r(2, 6), r(2, 9), r(1, 9)
        return f"Solve for n: n / {a} + {b} = {q + b}."

    def system():
        x, y = r(1, 12), r(1, 12)
        return f"Find x and y if x + y = {x + y} and x - y = {x - y}."

    def quadratic():
        p, q = r(1, 7), r(1, 7)
        return f"Find both solutions of x^2 - {p + q}x + {p * q} = 0."

    def percent_of():
        return f"What is {rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {r(2, 40) * 20}?"

    def discount():
        return (
            f"A jacket costs ${r(4, 30) * 10} and is on sale for {rng.choice([10, 15, 20, 25, 30, 50])}% off. "
            "What is the sale price?"
        )

    def tip():
        return (
            f"A dinner bill is ${r(20, 90)}. How much is a {rng.choice([10, 15, 18, 20])}% tip, and what is the total?"
        )

    def pct_increase():
        old = r(2, 20) * 10
        return f"A price rises from ${old} to ${old + r(1, 10) * old // 10}. By what percent did it increase?"

    def what_percent():
        whole = rng.choice([20, 25, 40, 50, 80])
        return (
            f"{r(1, whole - 1)} of the {whole} students in a class walk to school. What percent of the class is that?"
        )

    def simple_interest():
        return (
            f"How much simple interest does ${r(2, 20) * 100} earn in {r(2, 6)} years at "
            f"{rng.choice([2, 3, 4, 5, 6])}% per year?"
        )

    def km_to_m():
        return f"Convert {r(2, 95) / 10} kilometers to meters."

    def hours_minutes():
        return f"How many minutes are in {r(1, 9)} hours and {r(5, 55)} minutes?"

    def inches_cm():
        return f"Convert {r(2, 40)} inches to centimeters, using 1 inch = 2.54 cm."

    def c_to_f():
        return f"Convert {rng.choice([-10, 0, 5, 15, 20, 25, 30, 35, 40, 100])} degrees Celsius to Fahrenheit."

    def liters_ml():
        return f"A bottle holds {r(2, 30) / 4} liters. How many milliliters is that?"

    def kg_to_g():
        return f"How many grams are in {r(2, 9)}.{r(1, 9)} kilograms?"

    def days_to_hours():
        return f"How many hours are there in {r(2, 14)} days?"

    def rect_area():
        return f"A rectangle is {r(3, 25)} cm long and {r(2, 15)} cm wide. What are its area and its perimeter?"

    def square_side():
        s = r(3, 15)
        return f"A square has an area of {s * s} square meters. How long is each side?"

    def circle():
        return f"What is the area of a circle with radius {r(2, 10)} cm? Give the answer in terms of pi."

    def triangle_area():
        return f"A triangle has a base of {r(2, 20)} m and a height of {r(2, 16)} m. What is its area?"

    def box_volume():
        return f"What is the volume of a box that measures {r(2, 12)} cm by {r(2, 12)} cm by {r(2, 12)} cm?"

    def hypotenuse():
        a, b, _ = rng.choice([(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15), (7, 24, 25)])
        k = r(1, 2)
        return f"A right triangle has legs of length {a * k} and {b * k}. How long is the hypotenuse?"

    def third_angle():
        a, b = r(20, 80), r(20, 80)
        return f"Two angles of a triangle are {a} degrees and {b} degrees. What is the third angle?"

    def give_buy():
        n, k, m = r(10, 40), r(1, 9), r(2, 15)
        return f"{name()} has {n} {thing()}. After giving away {k} and buying {m} more, how many are left?"

    def share_equally():
        k = r(2, 8)
        return f"{k * r(3, 12)} {thing()} are shared equally among {k} children. How many does each child get?"

    def distance():
        return f"A train travels at {r(4, 12) * 10} km per hour for {r(2, 5)} hours. How far does it go?"

    def speed():
        t = r(2, 6)
        return f"A cyclist rides {t * r(10, 25)} km in {t} hours. What is her average speed?"

    def travel_time():
        v = rng.choice([40, 50, 60, 80])
        return f"How long does it take to drive {v * r(2, 7) // 2} km at {v} km per hour?"

    def wages():
        return (
            f"{name()} earns ${r(10, 25)} per hour and works {r(3, 8)} hours a day for {r(3, 6)} days. "
            "How much is that in total?"
        )

    def unit_price():
        n, m = r(2, 6), r(7, 15)
        return f"{n} notebooks cost ${n * r(2, 5)}. How much do {m} notebooks cost at the same price?"

    def change():
        a, b = r(3, 19), r(2, 9)
        return f"{name()} buys a sandwich for ${a} and a drink for ${b} and pays with a $50 bill. How much change is there?"

    def reading():
        p = r(10, 30)
        return f"A book has {p * r(8, 20) + r(0, p - 1)} pages. Reading {p} pages a day, how many days does it take to finish it?"

    def boxes():
        k = r(6, 12)
        return f"{r(50, 150)} eggs are packed into cartons of {k}. How many cartons are filled completely, and how many eggs are left over?"

    def recipe():
        s = rng.choice([2, 4, 6])
        return (
            f"A recipe for {s} people uses {r(1, 4) * s // 2 + 1} cups of flour. How much flour is needed "
            f"for {s * r(2, 3)} people?"
        )

    def ratio():
        a, b = r(1, 5), r(1, 5)
        return f"Red and blue paint are mixed in the ratio {a}:{b + (a == b)}. How much of each is in {(a + b + (a == b)) * r(2, 6)} liters of the mix?"

    def tank():
        rate = r(2, 9)
        return f"A tank holds {rate * r(10, 40)} liters and fills at {rate} liters per minute. How many minutes does it take to fill from empty?"

    def average():
        xs = [r(50, 100) for _ in range(r(3, 6))]
        return f"What is the average of {', '.join(map(str, xs[:-1]))} and {xs[-1]}?"

    def needed_score():
        k = r(3, 5)
        return (
            f"{name()}'s first {k} test scores average {r(70, 85)}. What score on the next test raises the "
            f"average to {r(86, 90)}?"
        )

    def median():
        xs = rng.sample(range(1, 60), r(5, 8))
        return f"Find the median of {', '.join(map(str, xs))}."

    def power():
        return f"What is {r(2, 9)} to the power of {r(2, 4)}?"

    def gcd():
        g = r(2, 12)
        return f"What is the greatest common divisor of {g * r(2, 9)} and {g * r(10, 15)}?"

    def lcm():
        return f"What is the least common multiple of {r(2, 12)} and {r(13, 20)}?"

    def prime():
        return f"Is {r(20, 200)} a prime number? Explain why or why not."

    def sum_to_n():
        return f"What is the sum of all whole numbers from 1 to {r(10, 100)}?"

    def fractions():
        b, d = r(2, 9), r(2, 9)
        return f"Add {r(1, b - 1)}/{b} and {r(1, d - 1)}/{d}, and write the result in lowest terms."

    def fraction_of():
        d = rng.choice([3, 4, 5, 8])
        return f"What is {r(1, d - 1)}/{d} of {d * r(3, 30)}?"

    def decimal_fraction():
        return (
            f"Write {rng.choice(['0.25', '0.6', '0.125', '0.75', '1.5', '0.35', '2.4'])} as a fraction in lowest terms."
        )

    def order_ops():
        a, b, c, d = r(2, 9), r(2, 9), r(2, 9), r(1, 9)
        return f"Evaluate {a} + {b} x {c} - {d}."

    def order_brackets():
        a, b, c = r(2, 9), r(2, 9), r(2, 5)
        return f"Evaluate ({a} + {b}) x {c} - {a} x {c}."

    def sqrt():
        return f"What is the square root of {r(4, 25) ** 2}?"

    def consecutive():
        n = r(5, 60)
        return f"The sum of two consecutive integers is {2 * n + 1}. What are they?"

    def consecutive_three():
        n = r(5, 40)
        return f"Three consecutive even numbers add up to {3 * (2 * n) + 6}. Find them."

    def ages():
        b, k = r(3, 15), r(2, 4)
        return f"{name()} is {k} times as old as a younger cousin. Together they are {b * (k + 1)} years old. How old is each?"

    def probability():
        red, blue = r(1, 9), r(1, 9)
        return (
            f"A bag has {red} red and {blue} blue marbles. What is the probability of drawing a red marble at random?"
        )

    def dice():
        return f"Two fair dice are rolled. What is the probability that the numbers add up to {r(2, 12)}?"

    def arrangements():
        return f"In how many different orders can {r(3, 7)} different books be placed on a shelf?"

    def choose():
        n = r(5, 10)
        return f"How many ways are there to choose {r(2, 3)} people from a group of {n}?"

    def slope():
        x1, y1, dx, k = r(-5, 5), r(-5, 5), r(1, 4), r(-3, 3)
        return f"What is the slope of the line through ({x1}, {y1}) and ({x1 + dx}, {y1 + k * dx})?"

    def line_eval():
        return f"If f(x) = {r(2, 7)}x - {r(1, 9)}, what is f({r(-4, 6)})?"

    def sequence():
        a, d = r(1, 10), r(2, 7)
        return f"The sequence {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, ... continues in the same way. What is its {r(10, 30)}th term?"

    def doubling():
        return f"A colony of {r(2, 20) * 5} bacteria doubles every hour. How many bacteria are there after {r(3, 8)} hours?"

    def remainder():
        return f"What is the remainder when {r(100, 999)} is divided by {r(3, 13)}?"

    def clock():
        h, m, d = r(1, 11), rng.choice([0, 10, 15, 20, 30, 45]), r(35, 170)
        return f"A movie starts at {h}:{m:02d} and lasts {d} minutes. At what time does it end?"

    def savings():
        goal, w = r(10, 30) * 10, r(5, 20)
        return f"{name()} saves ${w} a week toward a ${goal} bike. How many weeks until there is enough?"

    def perimeter_fence():
        return f"A garden is {r(5, 30)} m by {r(4, 20)} m. How many meters of fence go all the way around it?"

    return [
        linear,
        linear_minus,
        bracket,
        both_sides,
        divide_eq,
        system,
        quadratic,
        percent_of,
        discount,
        tip,
        pct_increase,
        what_percent,
        simple_interest,
        km_to_m,
        hours_minutes,
        inches_cm,
        c_to_f,
        liters_ml,
        kg_to_g,
        days_to_hours,
        rect_area,
        square_side,
        circle,
        triangle_area,
        box_volume,
        hypotenuse,
        third_angle,
        give_buy,
        share_equally,
        distance,
        speed,
        travel_time,
        wages,
        unit_price,
        change,
        reading,
        boxes,
        recipe,
        ratio,
        tank,
        average,
        needed_score,
        median,
        power,
        gcd,
        lcm,
        prime,
        sum_to_n,
        fractions,
        fraction_of,
        decimal_fraction,
        order_ops,
        order_brackets,
        sqrt,
        consecutive,
        consecutive_three,
        ages,
        probability,
        dice,
        arrangements,
        choose,
        slope,
        line_eval,
        sequence,
        doubling,
        remainder,
        clock,
        savings,
        perimeter_fence,
    ]


FREE_MATH = [
    "What is 15% of 15% of 400?",
    "A number doubled and then increased by 9 gives 41. What is the number?",
    "If 3 pens cost as much as 2 notebooks and a notebook costs $4.50, how much does one pen cost?",
    "How many seconds are in one day?",
    "Which is larger, 3/7 or 4/9? Show how you compare them.",
    "Round 3.14159 to two decimal places.",
    "Simplify the expression 4(x + 3) - 2(x - 5).",
    "Expand (x + 4)(x - 2).",
    "Factor x^2 + 7x + 12.",
    "What is 2^10?",
    "A week has 7 days. How many full weeks are in 100 days, and how many days are left over?",
    "A rope 12 m long is cut into pieces of 75 cm. How many pieces are there?",
    "The perimeter of a square is 36 cm. What is its area?",
    "How many edges does a cube have?",
    "What is the sum of the interior angles of a hexagon?",
    "A car uses 6 liters of fuel per 100 km. How much fuel does it need for 250 km?",
    "If a = 3 and b = -2, what is a^2 - 2ab + b^2?",
    "What is the next number in the pattern 2, 6, 18, 54, ...?",
    "Convert 2.5 hours to minutes.",
    "What is 7/8 written as a percentage?",
]


def build(seed: int = 20240917, per_template: int = 3) -> list[dict]:
    rng = random.Random(seed)
    records: list[dict] = []
    seen: set[str] = set()

    def add(prompt: str, kind: str) -> bool:
        if prompt in seen:
            return False
        seen.add(prompt)
        records.append({"id": f"{kind}-{sum(r['kind'] == kind for r in records):04d}", "prompt": prompt, "kind": kind})
        return True

    for i, (sig, what) in enumerate(FUNCTIONS):
        add(CODE_PHRASINGS[i % len(CODE_PHRASINGS)].format(sig=sig, what=what), "code")
    for prompt in FREE_CODE:
        add(prompt, "code")
    for template in _math_templates(rng):
        made = 0
        for _ in range(10 * per_template):  # redraw when a draw repeats an earlier question
            made += add(template(), "math")
            if made == per_template:
                break
    for prompt in FREE_MATH:
        add(prompt, "math")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-against", type=Path, help="folder of eval files that no prompt may appear in")
    args = parser.parse_args()
    records = build()
    if args.check_against:
        texts = []
        for path in sorted(args.check_against.glob("*.jsonl*")):
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                texts.append(f.read())
        blob = "\n".join(texts)
        hits = [r["prompt"] for r in records if json.dumps(r["prompt"])[1:-1] in blob or r["prompt"] in blob]
        if hits:
            raise SystemExit(f"{len(hits)} prompt(s) appear verbatim in {args.check_against}: {hits[:3]}")
    with open(OUT, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    kinds = {k: sum(r["kind"] == k for r in records) for k in ("code", "math")}
    print(f"wrote {len(records)} prompts to {OUT} ({kinds})")


if __name__ == "__main__":
    main()
