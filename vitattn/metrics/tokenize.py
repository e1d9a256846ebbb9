"""Caption tokenisation as the COCO caption toolkit does it (CoreNLP 3.4.1's PTBTokenizer), without Java: its
lexer's rules as Python regular expressions applied as JFlex applies them, token for token (docs/metrics.md)."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import cache

__all__ = ["COCO_PUNCTUATION", "coco_tokenize", "coco_tokenize_file", "one_line"]

# pycocoevalcap's PUNCTUATIONS, lower-cased as the tokens it compares them with are: its "-LRB-" and
# friends never match "-lrb-", so brackets stay.
COCO_PUNCTUATION = frozenset(["''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"])

_LINE_BREAK = re.compile("\r\n|[\r\n\u2028\u2029\x0b\x0c]")


def one_line(text: str) -> str:
    """The caption with its line breaks (those CoreNLP ends a line at) made spaces: the toolkit's captions
    are lines of one file, and it replaces only ``\\n`` itself."""
    return _LINE_BREAK.sub(" ", text)


@cache
def _unicode_classes() -> dict[str, str]:
    """Character-class bodies of JFlex's [:letter:], [:digit:] and [:uppercase:] over the BMP."""
    wanted = {"letter": ("Lu", "Ll", "Lt", "Lm", "Lo"), "digit": ("Nd",), "upper": ("Lu",)}
    categories = [unicodedata.category(chr(code)) for code in range(0x10000)]
    return {name: _class_body([c for c, cat in enumerate(categories) if cat in cats]) for name, cats in wanted.items()}


def _class_body(codes: list[int]) -> str:
    """A character class's body for sorted code points: runs written as ranges."""
    parts, start = [], codes[0]
    for prev, code in zip(codes, codes[1:] + [-1]):
        if code != prev + 1:
            parts.append(f"\\u{start:04x}" if start == prev else f"\\u{start:04x}-\\u{prev:04x}")
            start = code
    return "".join(parts)


# PTBLexer's LETTER adds these marks and letters to [:letter:] (combining accents among them).
_EXTRA_LETTERS = (
    r"\u00AD\u0237-\u024F\u02C2-\u02C5\u02D2-\u02DF\u02E5-\u02FF\u0300-\u036F\u0370-\u037D\u0384\u0385\u03CF"
    r"\u03F6\u03FC-\u03FF\u0483-\u0487\u04CF\u04F6-\u04FF\u0510-\u0525\u055A-\u055F\u0591-\u05BD\u05BF\u05C1"
    r"\u05C2\u05C4\u05C5\u05C7\u0615-\u061A\u063B-\u063F\u064B-\u065E\u0670\u06D6-\u06EF\u06FA-\u06FF\u070F"
    r"\u0711\u0730-\u074F\u0750-\u077F\u07A6-\u07B1\u07CA-\u07F5\u07FA\u0900-\u0903\u093C\u093E-\u094E"
    r"\u0951-\u0955\u0962-\u0963\u0981-\u0983\u09BC-\u09C4\u09C7\u09C8\u09CB-\u09CD\u09D7\u09E2\u09E3"
    r"\u0A01-\u0A03\u0A3C\u0A3E-\u0A4F\u0A81-\u0A83\u0ABC-\u0ACF\u0B82\u0BBE-\u0BC2\u0BC6-\u0BC8\u0BCA-\u0BCD"
    r"\u0C01-\u0C03\u0C3E-\u0C56\u0D3E-\u0D44\u0D46-\u0D48\u0E30-\u0E3A\u0E47-\u0E4E\u0EB1-\u0EBC\u0EC8-\u0ECD"
)
_MISC_SYMBOL = (
    r"+%&~\^|\\\u00A6\u00A7\u00A8\u00A9\u00AC\u00AE\u00AF\u00B0-\u00B3\u00B4-\u00BA\u00D7\u00F7\u0387\u05BE"
    r"\u05C0\u05C3\u05C6\u05F3\u05F4\u0600-\u0603\u0606-\u060A\u060C\u0614\u061B\u061E\u066A\u066D\u0703-\u070D"
    r"\u07F6\u07F7\u07F8\u0964\u0965\u0E4F\u1FBD\u2016\u2017\u2020-\u2023\u2030-\u2038\u203B\u203E-\u2042\u2044"
    r"\u207A-\u207F\u208A-\u208E\u2100-\u214F\u2190-\u21FF\u2200-\u2BFF\u3012\u30FB\uFF01-\uFF0F\uFF1A-\uFF20"
    r"\uFF3B-\uFF40\uFF5B-\uFF65"
)
_FILE_EXTENSIONS = (
    "bat bmp c class cgi cpp dll doc docx exe gif gz h htm html jar java jpeg jpg mov mp3 pdf php pl png ppt "
    "ps py sql tar txt wav x xml zip"
).split()
# The words after which ACRONYM takes "X." as a sentence's end: first letter upper case, the rest any case.
_SENTENCE_STARTS = (
    "About According Additionally After An A As At But Earlier He Her Here However If In It Last Many More Mr. "
    "Ms. Now Once One Other Our She Since So Some Such That The Their Then There These They This We When While "
    "What Yet You"
).split()


def _caseless(words: list[str]) -> str:
    """Literal words, any case (JFlex %caseless), the longest tried first."""
    return "(?i:" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + ")"


def _expand(pattern: str, macros: dict[str, str]) -> str:
    """``{NAME}`` references to the macros written out, as JFlex expands them."""
    return re.sub(r"\{([A-Z][A-Z0-9_]*)\}", lambda ref: f"(?:{macros[ref[1]]})", pattern)


@cache
def _macros() -> dict[str, str]:
    """PTBLexer.flex's macros as Python regular expressions: literals caseless, character classes not."""
    uni = _unicode_classes()
    m: dict[str, str] = {}

    def define(name: str, pattern: str) -> None:
        m[name] = _expand(pattern, m)

    define("SPACE", r"[ \t\u00A0\u2000-\u200A\u3000]")
    define("NEWLINE", r"\r\n|[\r\n\u2028\u2029\x0b\x0c\x85]")
    define("SPACENL", r"{SPACE}|{NEWLINE}")
    define("UPPER", f"[{uni['upper']}]")
    sgml_name = r"[A-Za-z][A-Za-z0-9_:.\-]*"
    define(
        "SGML",
        r"<(?:[!?][A-Za-z\-][^>\r\n]*"
        rf"|{sgml_name}(?:[ ]+(?:{sgml_name}[ ]*=[ ]*(?:'[^']*'|\"[^\"]*\")|{sgml_name}))*[ ]*/?"
        rf"|/{sgml_name})[ ]*>",
    )
    define("SENTEND", r"{SPACENL}(?:{SPACENL}|{UPPER}|{SGML})")
    define("SPMDASH", r"&(?i:md|mdash|ndash);|[\x96\x97\u2013\u2014\u2015]")
    define("SPAMP", r"(?i:&amp;)")
    define("SPPUNC", r"&(?i:ht|tl|ur|lr|qc|ql|qr|odq|cdq|#[0-9]+);")
    define("SPLET", r"&[aeiouAEIOU](?i:acute|grave|uml);")
    define("DIGIT", f"[{uni['digit']}]")
    define("LETTER", f"[{uni['letter']}{_EXTRA_LETTERS}]|{{SPLET}}")
    define("PLETTER", f"[{uni['letter']}]")  # JFlex's [:letter:] alone
    define("LD", f"[{uni['letter']}{uni['digit']}]")  # [:letter:] | [:digit:]
    define("DATE", r"{DIGIT}{1,2}[\-/]{DIGIT}{1,2}[\-/]{DIGIT}{2,4}")
    define("NUM", r"{DIGIT}*(?:[.:,\u00AD\u066B\u066C]{DIGIT}+)+|{DIGIT}+")
    define("NUMBER", r"[\-+]?{NUM}")
    define("SUBSUPNUM", r"[\u207A\u207B\u208A\u208B]?(?:[\u2070\u00B9\u00B2\u00B3\u2074-\u2079]+|[\u2080-\u2089]+)")
    define("FRAC", r"(?:{DIGIT}{1,4}[\- \u00A0])?{DIGIT}{1,4}(?:\\?/|\u2044){DIGIT}{1,4}")
    define("FRAC2", r"[\u00BC\u00BD\u00BE\u2153-\u215E]")
    define("DOLSIGN", r"[A-Z]*\$|#")
    define("DOLSIGN2", r"[\u00A2\u00A3\u00A4\u00A5\x80\u20A0\u20AC\u060B\u0E3F\u20A4\uFFE0\uFFE1\uFFE5\uFFE6]")
    define("WORD", r"{LETTER}(?:{LETTER}|{DIGIT})*(?:[.!?]{LETTER}(?:{LETTER}|{DIGIT})*)*")
    define("FILENAME", r"(?:{LETTER}|{DIGIT})+(?:\.(?:{LETTER}|{DIGIT})+)*\." + _caseless(_FILE_EXTENSIONS))
    define("APOS", r"['\x92\u2019]|(?i:&apos;)")
    define("APOSETCETERA", r"{APOS}|[`\x91\u2018\u201B]")
    define("HYPHEN", r"[\-_\u058A\u2010\u2011]")
    define("THING", r"(?:[dDoOlL]{APOSETCETERA}{LD})?{LD}+(?:{HYPHEN}(?:[dDoOlL]{APOSETCETERA}{LD})?{LD}+)*")
    define("THINGA", r"[A-Z]+(?:(?:[+&]|{SPAMP})[A-Z]+)+")
    define("THING3", r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}")
    acro_special = r"(?i:(?:canada|sino|korean|eu|japan|non)-u\.s|u\.s\.-(?:u\.k|u\.s\.s\.r))"
    define("ACRO", acro_special + r"|[A-Za-z](?:\.[A-Za-z])*")
    define("ACRO2", acro_special + r"|[A-Za-z](?:\.[A-Za-z])+")
    define("HTHING", r"[A-Za-z0-9][A-Za-z0-9.,\u00AD]*(?:-(?:{ACRO2}\.|[A-Za-z0-9\u00AD]+))+")
    define("REDAUX", r"{APOS}(?:[msdMSD]|(?i:re|ve|ll))")
    define("SWORD", r"[A-Za-z\u00AD]*[A-MO-Za-mo-z]\u00AD*")
    define("SREDAUX", r"(?i:n){APOSETCETERA}(?i:t)")
    define("URLCHARS", r"[^ \t\n\f\r\"<>|(){}]")
    define("URLEND", r"[^ \t\n\f\r\"<>|.!?(){},\-]")
    define("EMAILCHARS", r"[^ \t\n\f\r\"<>|(){}.\u00A0]")
    define("TWITTER", r"@[a-zA-Z_][a-zA-Z_0-9]*|#{LETTER}+")
    define(
        "ABSTATE",
        r"(?i:ala|ariz)|A(?i:z)|A(?i:rk)|(?i:calif|colo|conn|ct|dak)|D(?i:el)|(?i:fla|ga)|I(?i:ll)|(?i:ind|kans?|ky)"
        r"|L(?i:a)|M(?i:ass)|(?i:md|mich|minn)|M(?i:iss)|(?i:mo|mont|neb|nev|okla)|O(?i:re)|P(?i:a)|(?i:penn|tenn)"
        r"|T(?i:ex)|(?i:va|vt)|W(?i:ash)|(?i:wisc?|wyo)",
    )
    define("ABCOMP", r"(?i:inc|cos?|corp)|(?i:pp?t)[ye](?i:s)?|(?i:ltd|plc|rt|bancorp|bhd|assn|univ|intl|sys)")
    months_days = "jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thurs fri".split()
    define(
        "ABBREV1",
        r"(?:" + _caseless(months_days) + r"|{ABSTATE}|{ABCOMP}|(?i:tel|est|ext|sq)"
        r"|(?i:jr|sr|bros|(?:ed|ph)\.d|blvd|rd|esq)|(?i:etc|al|seq|bldg))\.",
    )
    define(
        "ABTITLE",
        r"(?i:mr|mrs|ms)|M(?i:iss)|(?i:drs?|profs?|sens?|reps?|attys?|lt|col|gen|messrs|govs?|adm|rev|maj|sgt|cpl"
        r"|pvt|capt|ste?|ave|pres|lieut|hon|brig|co?mdr|pfc|spc|supts?|det|mt|ft|adj|adv|asst|assoc|ens|insp|mlle"
        r"|mme|msgr|sfc)",
    )
    define(
        "ABBREV4",
        r"{ABTITLE}|(?i:vs|alex|wm|jos|cie|a\.k\.a|cf|treas|ph)|{ACRO}|(?i:invt|elec|natl|dept)|(?i:m)[ft](?i:g)",
    )
    define("ABBREV3", r"(?i:ca|figs?|prop|nos?|art|bldg|pp|op)\.")
    define("INSENTP", r"[,;:\u3001]")
    define("QUOTECHARS", r"[`\u2018\u2019\u201A\u201B\u201C\u201D\x91\x92\x93\x94\u201E\u201F\u2039\u203A\xAB\xBB]")
    define("FACE", r"[\-\^x=~<>']")
    return m


# What a rule makes of its match: the tokens, and how many characters it consumed (JFlex's pushback).
Action = Callable[[str], tuple[list[str], int]]


def _map(change: Callable[[str], str]) -> Action:
    """The whole match consumed, as one token changed by ``change``."""
    return lambda text: ([change(text)], len(text))


def _pushback(n: int) -> Action:
    """Keep all but the last ``n`` characters; they are read again (cannot -> can + not)."""
    return lambda text: ([text[:-n]], len(text) - n)


def _period_again(text: str) -> tuple[list[str], int]:
    """The abbreviation with its period, and the period once more as the sentence's end."""
    return [text], len(text) - 1


def _acronym(text: str) -> tuple[list[str], int]:
    # "I." before "The": the letter alone, the period next; "U.S." keeps it and gives it again.
    return ([text[0]], 1) if len(text) == 2 else ([text], len(text) - 1)


def _emit(token: str) -> Action:
    return _map(lambda text: token)


def _skip(text: str) -> tuple[list[str], int]:
    return [], len(text)


_keep = _map(str)
_no_soft_hyphens = _map(lambda text: text.replace("\u00ad", "") or "-")
_nbsp = _map(lambda text: text.replace(" ", "\u00a0"))
_brackets = _map(lambda text: text.replace("(", "-LRB-").replace(")", "-RRB-"))
_phone = _map(lambda text: text.replace(" ", "\u00a0").replace("(", "-LRB-").replace(")", "-RRB-"))
_amp = _map(lambda text: re.sub("(?i)&amp;", "&", text))
_dashes = _map(lambda text: "--" if 3 <= len(text) <= 4 else text)
_FRACTIONS = {"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3", "\u2154": "2/3"}
_CURRENCY = {"\u00a2": "cents", "\u00a3": "#", "\x80": "$", "\u00a4": "$", "\u20a0": "$", "\u20ac": "$"}
_CURLY = str.maketrans(
    {**dict.fromkeys("\x91\u2018\u201b\u2039", "`"), **dict.fromkeys("\x92\u2019\u203a", "'")}
    | {**dict.fromkeys("\x93\u201c\u00ab", "``"), **dict.fromkeys("\x94\u201d\u00bb", "''")}
)


def _quotes(probably_left: bool) -> Action:
    """PTB's LaTeX quotes: ` `` for opening, ' '' for closing; curly quotes by their own direction."""
    single, double = ("`", "``") if probably_left else ("'", "''")
    return _map(lambda text: re.sub('(?i)&quot;|"', double, re.sub("(?i)&apos;|'", single, text)).translate(_CURLY))


@cache
def _rules() -> list[tuple[re.Pattern[str], Action]]:
    """PTBLexer's rules in its .flex order; group ``t`` is the token, what follows JFlex's trailing context.
    Alternatives of different lengths are split, so Python's first match is still JFlex's longest."""
    m = _macros()
    starts = "|".join(w[0] + (f"(?i:{re.escape(w[1:])})" if len(w) > 1 else "") for w in _SENTENCE_STARTS)
    rules: list[tuple[str, Action]] = [
        (r"(?P<t>(?i:c\+\+|[cf]#))", _keep),
        (r"(?P<t>(?i:cannot))", _pushback(3)),
        (r"(?P<t>(?i:'twas))", _pushback(3)),
        (r"(?P<t>(?i:'tis))", _pushback(2)),
        (r"(?P<t>(?i:gonna|gotta|lemme|gimme|wanna))", _pushback(2)),
        (r"(?P<t>{SGML})", _nbsp),
        (r"(?P<t>{SPMDASH})", _emit("--")),
        (r"(?P<t>{SPAMP})", _amp),
        (r"(?P<t>{SPPUNC})", _keep),
        (r"(?P<t>{WORD}){REDAUX}", _no_soft_hyphens),
        (r"(?P<t>{SWORD}){SREDAUX}", _no_soft_hyphens),
        (r"(?P<t>{WORD})", _no_soft_hyphens),
        *[
            (f"(?P<t>{alternative})", _keep)
            for alternative in (
                r"{APOS}(?i:n){APOS}?",
                r"[lLdDjJ]{APOS}",
                r"(?i:dunkin|somethin|ol){APOS}",
                r"{APOS}(?i:em)",
                r"[A-HJ-XZn]{APOSETCETERA}{PLETTER}{2}{PLETTER}*",
                r"{APOS}[2-9]0(?i:s)",
                r"{APOS}(?i:till?)",
                r"{PLETTER}+[aeiouyAEIOUY]{APOSETCETERA}[aeiouA-Z]{PLETTER}*",
                r"{APOS}(?i:cause)",
                r"(?i:cont'd\.?)",
                r"(?i:'twas|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)",
                r"(?i:o){APOSETCETERA}(?i:o)",
            )
        ],
        (r"(?P<t>(?i:y){APOS}){PLETTER}", _keep),
        (r"(?P<t>(?i:https?)://{URLCHARS}+{URLEND})", _keep),
        (r"(?P<t>(?i:www)\.(?:[^ \t\n\f\r\"<>|.!?(){},]+\.)+[a-zA-Z]{2,4}(?:/[^ \t\n\f\r\"<>|()]+{URLEND})?)", _keep),
        (
            r"(?P<t>(?:[^ \t\n\f\r\"`'<>|.!?(){},-_$]+\.)+(?i:com|net|org|edu)(?:/[^ \t\n\f\r\"<>|()]+{URLEND})?)",
            _keep,
        ),
        (
            r"(?P<t>(?:(?i:&lt;)|<)?[a-zA-Z0-9][^ \t\n\f\r\"<>|()\u00A0{}]*@(?:{EMAILCHARS}+\.)*{EMAILCHARS}+"
            r"(?:(?i:&gt;)|>)?)",
            _keep,
        ),
        (r"(?P<t>{TWITTER})", _keep),
        (r"(?P<t>{REDAUX})[^A-Za-z]", _quotes(False)),
        (r"(?P<t>{SREDAUX})[^A-Za-z]", _quotes(False)),
        (r"(?P<t>{DATE})", _keep),
        (r"(?P<t>{NUMBER})", _no_soft_hyphens),
        (r"(?P<t>{SUBSUPNUM})", _keep),
        (r"(?P<t>{FRAC})", _nbsp),
        (r"(?P<t>{FRAC2})", _map(lambda text: _FRACTIONS.get(text, text))),
        *[
            (f"(?P<t>{alternative})", _amp)
            for alternative in (
                r"-(?i:rrb|lrb|rcb|lcb|rsb|lsb)-",
                r"(?i:c\.d\.s|pro-|anti-)",
                r"(?i:s)(?:&|{SPAMP})(?i:p-500)",
                r"(?i:s)(?:&|{SPAMP})(?i:ls)",
                r"(?i:cap){APOS}(?i:n)",
                r"(?i:c){APOS}(?i:est)",
            )
        ],
        (r"(?P<t>{THING3})", _keep),
        (r"(?P<t>{DOLSIGN})", _keep),
        (r"(?P<t>{DOLSIGN2})", _map(lambda text: _CURRENCY.get(text, text))),
        (rf"(?P<t>{{ACRO}}\.)(?:{{SPACENL}})+(?:{starts}|{{SGML}}){{SPACENL}}", _acronym),
        (r"(?P<t>{ABBREV3}){SPACENL}?{DIGIT}", _keep),
        (r"(?P<t>(?:(?i:pt)[eyEY]|(?i:co))\.){SPACE}(?i:ltd|lim)", _keep),
        (r"(?P<t>{ABBREV1}){SENTEND}", _period_again),
        (r"(?P<t>{ABBREV1})[\s\S]{2}", _keep),
        (r"(?P<t>{ABBREV1})", _period_again),
        (r"(?P<t>(?:{ABBREV4})\.)", _keep),
        (r"(?P<t>{ABBREV4}){SPACE}", _keep),
        (r"(?P<t>{ACRO}){SPACENL}", _keep),
        (r"(?P<t>{APOS}[0-9][0-9]){SPACENL}", _keep),
        (r"(?P<t>{FILENAME})(?:{SPACENL}|[.?!,])", _keep),
        (r"(?P<t>{WORD}\.){INSENTP}", _no_soft_hyphens),
        (
            r"(?P<t>(?:\([0-9]{2,3}\)[ \u00A0]?|(?:\+\+?)?(?:[0-9]{2,4}[\- \u00A0])?[0-9]{2,4}[\- \u00A0])"
            r"[0-9]{3,4}[\- \u00A0]?[0-9]{3,5})",
            _phone,
        ),
        (r"(?P<t>(?:(?:\+\+?)?[0-9]{2,4}\.)?[0-9]{2,4}\.[0-9]{3,4}\.[0-9]{3,5})", _phone),
        (r"(?P<t>\"|(?i:&quot;))[A-Za-z0-9$]", _quotes(True)),
        (r"(?P<t>\"|(?i:&quot;))", _quotes(False)),
        (r"(?P<t>\x7f)", _skip),
        (r"(?P<t><|(?i:&lt;))", _emit("<")),
        (r"(?P<t>>|(?i:&gt;))", _emit(">")),
        (r"(?P<t>[<>]?[:;=][\-o*']?[()DPdpO\\{@|\[\]])[^A-Za-z0-9]", _brackets),
        *[
            (f"(?P<t>{alternative})", _brackets)
            for alternative in (
                r"[\^x=~<>]\.\[\^(?i:x)=~<>\]",
                r"{FACE}_{FACE}",
                r"\({FACE}[_.]?{FACE}\)",
                r"\([\^x=~<>']-[\^x=~<>'`]\)",
            )
        ],
        *[
            (f"(?P<t>{re.escape(c)})", _emit(f"-{name}-"))
            for c, name in zip("{}[]()", "LCB RCB LSB RSB LRB RRB".split())
        ],
        (r"(?P<t>-+)", _dashes),
        (r"(?P<t>\.{3,5})", _emit("...")),
        (r"(?P<t>(?:\.[ \u00A0]){2,4}\.)", _emit("...")),
        (r"(?P<t>[\x85\u2026])", _emit("...")),
        # consecutive rules of one action, their alternatives starting with different characters: one rule
        (
            r"(?P<t>@+|#+|_+|\*+|(?:\\\*){1,3}|{INSENTP}|[?!]+|[.\u00A1\u00BF\u037E\u0589\u061F\u06D4\u0700-\u0702\u07FA\u3002=/])",
            _keep,
        ),
        (r"(?P<t>{HTHING}\.){INSENTP}", _no_soft_hyphens),
        (r"(?P<t>{HTHING})", _no_soft_hyphens),
        (r"(?P<t>{THING}\.){INSENTP}", _keep),
        (r"(?P<t>{THING})", _keep),
        (r"(?P<t>{THINGA}\.){INSENTP}", _amp),
        (r"(?P<t>{THINGA})", _amp),
        (r"(?P<t>')[A-Za-z][^ \t\n\r\u00A0]", _quotes(True)),
        (r"(?P<t>{REDAUX})", _quotes(False)),
        (r"(?P<t>{SREDAUX})", _quotes(False)),
        (r"(?P<t>'')", _quotes(False)),
        (r"(?P<t>{QUOTECHARS}{1,2})", _quotes(False)),
        (r"(?P<t>{APOS})", _quotes(False)),
        (f"(?P<t><<|>>|[{_MISC_SYMBOL}])", _keep),
        (r"(?P<t>\x00|{SPACE}+|[\u200B\u200E\u200F\uFEFF]|{NEWLINE}|(?i:&nbsp;))", _skip),
    ]
    return [(re.compile(_expand(pattern, m)), action) for pattern, action in rules]


# Most of a caption is ASCII words between spaces, which every rule reads as the word itself except the
# few that the assimilation rules split (cannot, gonna...), a comma before a space, and a final period
# after a word that is no abbreviation: these skip the rules.
_PLAIN = re.compile(
    r"(?P<space>[ \t][ \t\u00A0\u2000-\u200A\u3000]*)|(?P<word>[A-Za-z]+)(?=[ \n]|,[ \n])|(?P<comma>,)(?=[ \n])"
    r"|(?P<last>[A-Za-z]+)(?P<period>\.)(?=\n)|(?P<end>\.)(?=\n)"
)
_ASSIMILATIONS = frozenset("cannot gonna gotta lemme gimme wanna".split())


@cache
def _abbreviation() -> re.Pattern[str]:
    m = _macros()
    return re.compile(f"(?:{m['ABBREV1']})|(?:{m['ABBREV4']})\\.|{m['ABBREV3']}")


def _plain(text: str, pos: int) -> tuple[list[str], int] | None:
    """``(tokens, end)`` where the rules can be skipped, else None."""
    match = _PLAIN.match(text, pos)
    if match is None:
        return None
    word = match["word"] or match["last"]
    if word is not None and word.lower() in _ASSIMILATIONS:
        return None
    if match["last"] is not None and _abbreviation().fullmatch(word + "."):
        return None
    tokens = [t for t in (word, match["comma"], match["period"], match["end"]) if t is not None]
    return tokens, match.end()


def _lex(text: str, end: int) -> list[str]:
    """PTBLexer's tokens of ``text[:end]``, before lower-casing; the rest of ``text`` is only looked at."""
    rules = _rules()
    tokens: list[str] = []
    pos = 0
    while pos < end:
        plain = _plain(text, pos)
        if plain is not None:
            tokens += plain[0]
            pos = plain[1]
            continue
        best_length, best = 0, None
        for pattern, action in rules:
            match = pattern.match(text, pos)
            if match and match.end() - pos > best_length:
                best_length, best = match.end() - pos, (match["t"], action)
        if best is None:  # untokenizable (an emoji outside the BMP, a control character): deleted
            pos += 1
            continue
        made, consumed = best[1](best[0])
        tokens += made
        pos += consumed
    return tokens


# A caption of ASCII words, spaces, commas and a final period, as most are: its words, unless one is split
# by an assimilation rule or the last is an abbreviation that keeps the period.
_SIMPLE = re.compile(r" *[A-Za-z]+(?: *,? +[A-Za-z]+)* *(?P<period>\.)? *")


def _simple(text: str) -> list[str] | None:
    match = _SIMPLE.fullmatch(text)
    if match is None:
        return None
    words = text.replace(",", " ").replace(".", " ").split()
    lowered = [word.lower() for word in words]
    if _ASSIMILATIONS.intersection(lowered):
        return None
    if match["period"] and _abbreviation().fullmatch(words[-1] + "."):
        return None
    return lowered


_BEYOND_BMP = re.compile("[\U00010000-\U0010ffff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf16(text: str) -> str:
    """Java reads text as UTF-16: each character beyond the BMP (most emoji) as two surrogates, which the
    rules see one by one (no rule takes them, so alone they are deleted; a URL keeps them)."""
    return _BEYOND_BMP.sub(lambda c: chr(0xD7C0 + (ord(c[0]) >> 10)) + chr(0xDC00 + (ord(c[0]) & 0x3FF)), text)


def _from_utf16(token: str) -> str:
    if _SURROGATE.search(token) is None:
        return token
    return token.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _tokenize_line(line: str, following: str | None) -> list[str]:
    """The toolkit's tokens of one line of its file, ``following`` being what comes after its line break."""
    simple = _simple(line)
    if simple is not None:
        return simple
    text = _utf16(line)
    tokens = _lex(text if following is None else text + "\n" + _utf16(following), len(text))
    # The toolkit strips the line's end, splits it at spaces and drops punctuation.
    joined = " ".join(_from_utf16(token).lower() for token in tokens).rstrip()
    return [token for token in joined.split(" ") if token and token not in COCO_PUNCTUATION]


def coco_tokenize(text: str) -> list[str]:
    """A caption's tokens as the toolkit gives them: ``"A Dog's toy (red)."`` -> ``a dog 's toy -lrb- red -rrb-``."""
    return _tokenize_line(one_line(text), "")


@cache
def _blank() -> re.Pattern[str]:
    return re.compile(f"(?:{_macros()['SPACENL']})*")


def coco_tokenize_file(captions: Sequence[str]) -> list[list[str]]:
    """One token list per caption, tokenised as the toolkit does when it scores them: one file, a line each,
    in this order (a few PTB rules look past a line's end: ``"vitamin C."`` gives ``c`` or ``c.`` by what follows)."""
    lines = [one_line(c) for c in captions]
    blank = _blank()
    tokens: list[list[str]] = [[] for _ in lines]
    next_text = None  # the lines after the current one, up to the first that is not blank, and its line break
    for i in range(len(lines) - 1, -1, -1):
        tokens[i] = _tokenize_line(lines[i], next_text)
        if next_text is None or not blank.fullmatch(lines[i]):
            next_text = lines[i] if i == len(lines) - 1 else lines[i] + "\n"
        else:
            next_text = lines[i] + "\n" + next_text
    return tokens
