package main

// The kinds of option value (field): how each option's text is parsed,
// checked and stored into Options, and printed back for --help.

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
)

func stringField(p func(*Options) *string) field {
	return field{
		set: func(o *Options, v string) error { *p(o) = v; return nil },
		get: func(o *Options) string { return *p(o) },
	}
}

// enumField accepts one of the given values.
func enumField(p func(*Options) *string, values ...string) field {
	return field{
		set: func(o *Options, v string) error {
			if !slices.Contains(values, v) {
				return fmt.Errorf("%q is not one of %s", v, strings.Join(values, ", "))
			}
			*p(o) = v
			return nil
		},
		get: func(o *Options) string { return *p(o) },
	}
}

// listField makes a repeatable option: every occurrence accumulates,
// after check (if any) accepted it.
func listField(p func(*Options) *[]string, check func(string) error) field {
	return field{
		set: func(o *Options, v string) error {
			if check != nil {
				if err := check(v); err != nil {
					return err
				}
			}
			*p(o) = append(*p(o), v)
			return nil
		},
		get: func(o *Options) string { return strings.Join(*p(o), " ") },
	}
}

func intField(p func(*Options) *int) field {
	return field{
		set: func(o *Options, v string) error {
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("%q is not a number", v)
			}
			*p(o) = n
			return nil
		},
		get: func(o *Options) string { return strconv.Itoa(*p(o)) },
	}
}

// uintField is intField for values that cannot be negative: a negative
// value in the field means the option was not given.
func uintField(p func(*Options) *int) field {
	return field{
		set: func(o *Options, v string) error {
			n, err := strconv.ParseUint(v, 10, 31)
			if err != nil {
				return fmt.Errorf("%q is not a non-negative number", v)
			}
			*p(o) = int(n)
			return nil
		},
		get: func(o *Options) string {
			if *p(o) < 0 {
				return ""
			}
			return strconv.Itoa(*p(o))
		},
	}
}

// boolField sets *p; notBoolField sets it to the negation
// (--no-killpriv-v2).
func boolField(p func(*Options) *bool) field { return boolOf(p, false) }

func notBoolField(p func(*Options) *bool) field { return boolOf(p, true) }

func boolOf(p func(*Options) *bool, negate bool) field {
	return field{
		set: func(o *Options, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("%q is not a boolean", v)
			}
			*p(o) = b != negate
			return nil
		},
		get: func(o *Options) string { return strconv.FormatBool(*p(o) != negate) },
	}
}

// noEffect takes any value of the kind and changes nothing (options with
// a note only).
func noEffect(kind optKind) field {
	return field{set: func(o *Options, v string) error {
		switch kind {
		case optInt:
			if _, err := strconv.ParseUint(v, 10, 31); err != nil {
				return fmt.Errorf("%q is not a non-negative number", v)
			}
		case optBool:
			if _, err := strconv.ParseBool(v); err != nil {
				return fmt.Errorf("%q is not a boolean", v)
			}
		}
		return nil
	}}
}

// modeField is a negotiation mode, the Rust virtiofsd 1.14's
// --posix-acl[=never|auto|always]: the bare flag (and -o KEY) is always,
// -o no_KEY never, and the boolean words of 1.13's flag keep their
// meaning (true: always, false: never).
func modeField(p func(*Options) *string) field {
	return field{
		set: func(o *Options, v string) error {
			switch v {
			case passthrough.NegotiateNever, passthrough.NegotiateAuto, passthrough.NegotiateAlways:
				*p(o) = v
				return nil
			}
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("%q is not one of never, auto, always", v)
			}
			*p(o) = passthrough.NegotiateNever
			if b {
				*p(o) = passthrough.NegotiateAlways
			}
			return nil
		},
		get: func(o *Options) string { return *p(o) },
	}
}

// debugField is the C daemon's -d and -o debug: --log-level=debug.
var debugField = field{set: func(o *Options, v string) error {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("%q is not a boolean", v)
	}
	if b {
		o.LogLevel = "debug"
	}
	return nil
}}

// inodeFileHandlesField is --inode-file-handles; "fallback" is the Rust
// daemon's deprecated alias of prefer (1.13.2 and 1.14.0 take it: checked).
var inodeFileHandlesField = field{
	set: func(o *Options, v string) error {
		if v == "fallback" {
			v = "prefer"
		}
		return enumField(func(o *Options) *string { return &o.InodeFileHandles }, "never", "prefer", "mandatory").set(o, v)
	},
	get: func(o *Options) string { return o.InodeFileHandles },
}

func checkIDMapping(v string) error {
	_, err := passthrough.ParseIDMapping(v)
	return err
}

// checkNSMap checks a --uid-map/--gid-map value, the Rust daemon's
// ":namespace_id:host_id:count:" (any one separator character, given
// first and last).
func checkNSMap(v string) error {
	if len(v) < 2 || v[0] != v[len(v)-1] {
		return fmt.Errorf("%q: want :inside:outside:count:", v)
	}
	fields := strings.Split(v[1:len(v)-1], v[:1])
	if len(fields) != 3 {
		return fmt.Errorf("%q: want :inside:outside:count:", v)
	}
	for _, f := range fields {
		if _, err := strconv.ParseUint(f, 10, 32); err != nil {
			return fmt.Errorf("%q: %q is not an id", v, f)
		}
	}
	return nil
}

// --inode-dax's values.
const (
	InodeDAXAll  = "all"
	InodeDAXFlag = "flag"
)

// parseSize parses a byte count: a decimal number with an optional K, M
// or G suffix (either case, powers of 1024).
func parseSize(v string) (uint64, error) {
	num, shift := v, 0
	if n := len(v); n > 0 {
		switch v[n-1] {
		case 'K', 'k':
			num, shift = v[:n-1], 10
		case 'M', 'm':
			num, shift = v[:n-1], 20
		case 'G', 'g':
			num, shift = v[:n-1], 30
		}
	}
	if num == "" || num[0] == '+' || num[0] == '-' {
		return 0, fmt.Errorf("%q is not a size (a number with an optional K, M or G suffix)", v)
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil || n > (1<<64-1)>>shift {
		return 0, fmt.Errorf("%q is not a size (a number with an optional K, M or G suffix)", v)
	}
	return n << shift, nil
}

// cacheSizeField is --cache-size: 0, or a window size the back end takes
// (a power of two from 2M to 512M).
var cacheSizeField = field{
	set: func(o *Options, v string) error {
		n, err := parseSize(v)
		if err != nil {
			return err
		}
		if n != 0 {
			if err := vhostuser.CheckCacheSize(n); err != nil {
				return fmt.Errorf("%q: %w; want 0 (no DAX window) or a power of two from 2M to 512M", v, err)
			}
		}
		o.CacheSize = n
		return nil
	},
	get: func(o *Options) string { return strconv.FormatUint(o.CacheSize, 10) },
}
