#!/usr/bin/env python3
"""Expected outputs of small templates from Jinja2 as transformers configures it (versions in requirements.txt).

Writes tests/fixtures/tokenizer/jinja_cases.json: template, context and either the output or the error Jinja2
raised (Vavilov must then raise one too). Each case exercises one construct the real chat templates rely on.
"""
import json
import pathlib

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "tokenizer"

MESSAGES = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi, <b>you</b>!"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello", "tool_calls": [
                {"function": {"name": "f", "arguments": {"x": 1.5, "y": [True, None], "z": "é\n\"q\""}}}]}]
CONTEXT = {"messages": MESSAGES, "n": 7, "f": 2.5, "s": "Hello World", "empty": [], "nothing": None,
           "d": {"b": 2, "a": 1, "items": "key named items"}}

TEMPLATES = [
    # Whitespace control: trim_blocks, lstrip_blocks, -, +, comments, trailing newline.
    "a\n  {% if true %}\n  b\n  {% endif %}\nc\n",
    "x {%- if true -%} y {%- endif -%} z",
    "  {%+ if true %}kept{% endif %}",
    "{# comment #}\n  {#- c -#}  text",
    "{{ 'x' }}  {% if true %}y{% endif %}",
    "line\n    {{- ' joined' }}",
    "{% raw %}{{ not evaluated }}{% endraw %}",
    # Literals, operators and precedence.
    "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 3 ** 2 }}",
    "{{ 7 / 2 }} {{ 4 / 2 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 3.0 }} {{ -0.0 }}",
    "{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ [1] + [2, 3] }}",
    "{{ not 1 == 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'b' in 'abc' }} {{ 2 not in [1, 3] }}",
    "{{ messages|length - 1 }} {{ -n|abs }} {{ n is odd and n is not even }}",
    "{{ 'yes' if n > 3 else 'no' }} {{ 'x' if false }}|",
    "{{ none }} {{ true }} {{ [1, 'a', none, 2.0, {'k': 'v'}] }} {{ {'a': [1, 2]} }} {{ \"it's\" }} {{ ['it\\'s'] }}",
    "{{ 'tab\\tnew\\nline \\u00e9 \\x41 \\\\' }}",
    # Attribute and item access.
    "{{ messages[0].role }} {{ messages[-1]['role'] }} {{ messages[5] is defined }} {{ d.a }} {{ d['b'] }}",
    "{{ d.items is defined }} {{ d.get('a') }} {{ d.get('zz', 'dflt') }} {{ d.missing is undefined }}",
    "{{ messages[::-1][0].role }} {{ [1, 2, 3, 4, 5][1:4] }} {{ 'abcdef'[::2] }} {{ 'héllo'[1:3] }} {{ s[-5:] }}",
    "{{ nothing.attr is defined }}",
    # String methods.
    "{{ messages[0].content.strip() }}|{{ '--x--'.strip('-') }}|{{ '  a '.lstrip() }}|{{ ' a  '.rstrip() }}|",
    "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }}",
    "{{ s.startswith('Hell') }} {{ s.endswith(('x', 'ld')) }} {{ s.replace('l', 'L', 2) }} {{ s.upper() }}",
    "{{ s.lower() }} {{ 'hello wORLD'.title() }} {{ 'hELLO'.capitalize() }} {{ s.find('o') }} {{ s.count('l') }}",
    "{{ '-'.join(['a', 'b']) }} {{ 'x'.join('abc') }} {{ '123'.isdigit() }} {{ 'ab1'.isalpha() }}",
    "{{ messages[2].content.split('</think>')[-1].lstrip('\\n') }}",
    # Filters.
    "{{ messages[2].tool_calls[0].function.arguments|tojson }}",
    "{{ d|tojson }} {{ d|tojson(indent=2) }} {{ d|tojson(sort_keys=true) }} {{ [1, 2]|tojson(separators=(',', ':')) }}",
    "{{ 'a\\u0001b\\u007f'|tojson }} {{ [1.0, 1e16, 1e-5, -0.5]|tojson }} {{ empty|tojson }} {{ {}|tojson }}",
    "{{ missing|default('dflt') }} {{ ''|default('x') }} {{ ''|default('x', true) }} {{ nothing|d('n') }}",
    "{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A']|sort(case_sensitive=true) }} {{ [1, 2]|sort(reverse=true) }}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
    "{{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|list }} {{ [0, 1, 2]|select|list }}",
    "{{ [1, 2, 3]|reject('odd')|list }} {{ ['a', 'b']|map('upper')|list }} {{ [1, 2, 2, 1]|unique|list }}",
    "{{ s|length }} {{ d|length }} {{ 'héllo'|length }} {{ missing|length }} {{ [1, 2]|first }} {{ [1, 2]|last }}",
    "{{ '  x  '|trim }} {{ 'xxaxx'|trim('x') }} {{ s|replace('o', '0') }} {{ s|lower }} {{ s|upper }} {{ s|title }}",
    "{{ '3'|int + 1 }} {{ 'x'|int }} {{ '2.5'|float }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 3|float }} {{ 3.9|int }}",
    "{{ d|items|list }} {{ d|dictsort }} {{ [1, 2, 3]|sum }} {{ [4, 1, 9]|max }} {{ [4, 1, 9]|min }} {{ 'abc'|reverse }}",
    "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ '<a & b>'|e }} {{ 'one two  three'|wordcount }}",
    "{{ [1, 2, 3]|reverse|list }} {{ 'ab'|list }} {{ 5|string ~ '!' }} {{ [1, 'a']|join }}",
    # Tests.
    "{{ 1 is number }} {{ 1.5 is float }} {{ 1 is integer }} {{ 'a' is string }} {{ d is mapping }} {{ empty is iterable }}",
    "{{ none is none }} {{ false is false }} {{ 0 is false }} {{ true is true }} {{ 1 is boolean }} {{ n is divisibleby 7 }}",
    "{{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 2 is in [1, 2] }} {{ nothing is sameas none }} {{ 3 is gt 2 }}",
    # Statements: loops, scoping, namespaces, macros, set blocks, loop controls.
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.revindex }}{{ loop.previtem is defined }}{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ m.role }}{{ loop.index }} {% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {% for k in d %}{{ k }}{% endfor %}",
    "{% for x in empty %}x{% else %}empty{% endfor %} {% for c in 'ab' %}{{ c }}{% endfor %}",
    "{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}",
    "{% set ns = namespace(total=0, seen=[]) %}{% for i in range(4) %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }}",
    "{% if true %}{% set y = 5 %}{% endif %}{{ y }} {% set a, b = [1, 2] %}{{ a }}{{ b }}",
    "{% set block %}inner {{ n }}{% endset %}[{{ block }}]",
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ana') }} {{ greet('Bo', punct='?') }}",
    "{% macro outer() %}<{{ caller() }}>{% endmacro %}{% call outer() %}body{% endcall %}",
    "{% filter upper %}shout {{ s }}{% endfilter %}",
    "{% with z = n * 2 %}{{ z }}{% endwith %}{{ z is defined }}",
    "{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ dict(a=1, b='x') }}",
    "{% for i in range(3) %}{{ loop.cycle('odd', 'even') }} {% endfor %}",
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ add_generation_prompt }}",
    "{% generation %}tracked{% endgeneration %}",
    # Errors Jinja2 raises (and so must we).
    "{{ missing.attr }}",
    "{{ 'a' + 1 }}",
    "{{ missing + 'x' }}",
    "{{ raise_exception('bad conversation') }}",
    "{{ x | nosuchfilter }}",
    "{% if true %}unclosed",
    "{% include 'other.html' %}",
    "{{ 1 / 0 }}",
    "{% for x in nothing %}{% endfor %}",
    "{{ messages.append(1) }}",
    "{% set n.attr = 1 %}",
    "{{ 'abc' + }}",
]


def main():
    assert jinja2.__version__ == "3.1.6", jinja2.__version__
    cases = []
    for source in TEMPLATES:
        case = {"template": source}
        try:
            case["expected"] = _compile_jinja_template(source).render(**CONTEXT)
        except Exception as error:  # the error is the expectation for this template
            case["error"] = f"{type(error).__name__}: {error}"
        cases.append(case)
    output = {"context": CONTEXT, "cases": cases}
    (FIXTURES / "jinja_cases.json").write_text(json.dumps(output, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(cases)} templates, {sum('error' in case for case in cases)} expected errors")


if __name__ == "__main__":
    main()
