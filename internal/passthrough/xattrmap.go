package passthrough

import (
	"bytes"
	"fmt"
	"strings"
	"syscall"
	"unicode"
)

// xattrMap translates xattr names between guest and host with the C
// daemon's xattrmap rules (docs/tools/virtiofsd.rst of QEMU 5.2–7.2, also
// accepted by the Rust daemon):
//
//	:type:scope:key:prepend:     type prefix|ok|bad|unsupported, scope client|server|all
//	:map:key:prepend:            shorthand, at most once and last
//
// The first character of a rule is its separator. Guest names (GET/SET/
// REMOVEXATTR) are matched against key by the client rules, host names
// (LISTXATTR) against prepend by the server rules; the first match decides.
// prefix prepends (client) or strips (server) prepend; ok passes the name;
// bad refuses it with EPERM (ENODATA for GETXATTR) or hides it;
// unsupported refuses with ENOTSUP or hides it. A name no rule matches is
// treated as bad.
type xattrMap struct {
	rules []xattrRule
}

type xattrRuleType int

const (
	xrPrefix xattrRuleType = iota
	xrOK
	xrBad
	xrUnsupported
)

type xattrRule struct {
	typ            xattrRuleType
	client, server bool
	key, prepend   []byte
}

func parseXattrMap(s string) (*xattrMap, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	m := &xattrMap{}
	rest := s
	sawMap := false
	for {
		rest = strings.TrimLeftFunc(rest, unicode.IsSpace)
		if rest == "" {
			break
		}
		if sawMap {
			return nil, fmt.Errorf("xattrmap: the 'map' rule must be the last one")
		}
		fields := &ruleFields{sep: rest[:1], rest: rest[1:]}
		r, isMap, err := fields.rule()
		if err != nil {
			return nil, err
		}
		rest = fields.rest
		if isMap {
			m.addMap(r.key, r.prepend)
			sawMap = true
			continue
		}
		m.rules = append(m.rules, r)
	}
	if len(m.rules) == 0 {
		return nil, fmt.Errorf("xattrmap: no rules")
	}
	return m, nil
}

// ruleFields reads the fields of one rule, each closed by sep (the rule's
// first character).
type ruleFields struct {
	rest, sep string
}

func (r *ruleFields) next(what string) (string, error) {
	i := strings.Index(r.rest, r.sep)
	if i < 0 {
		return "", fmt.Errorf("xattrmap: missing %s (or its closing %q)", what, r.sep)
	}
	f := r.rest[:i]
	r.rest = r.rest[i+1:]
	return f, nil
}

// rule reads a rule, or a map rule (isMap: only its key and prepend).
func (r *ruleFields) rule() (rule xattrRule, isMap bool, err error) {
	typ, err := r.next("type")
	if err != nil {
		return rule, false, err
	}
	if isMap = typ == "map"; !isMap {
		if err := r.typeAndScope(typ, &rule); err != nil {
			return rule, false, err
		}
	}
	key, err := r.next("key")
	if err != nil {
		return rule, false, err
	}
	prepend, err := r.next("prepend")
	if err != nil {
		return rule, false, err
	}
	rule.key, rule.prepend = []byte(key), []byte(prepend)
	return rule, isMap, nil
}

// typeAndScope sets rule's type from typ, and its scope from the next
// field.
func (r *ruleFields) typeAndScope(typ string, rule *xattrRule) error {
	switch typ {
	case "prefix":
		rule.typ = xrPrefix
	case "ok":
		rule.typ = xrOK
	case "bad":
		rule.typ = xrBad
	case "unsupported":
		rule.typ = xrUnsupported
	default:
		return fmt.Errorf("xattrmap: unknown rule type %q", typ)
	}
	scope, err := r.next("scope")
	if err != nil {
		return err
	}
	switch scope {
	case "client":
		rule.client = true
	case "server":
		rule.server = true
	case "all":
		rule.client, rule.server = true, true
	default:
		return fmt.Errorf("xattrmap: unknown scope %q", scope)
	}
	return nil
}

// addMap expands ":map:key:prepend:" as the C daemon does.
func (m *xattrMap) addMap(key, prepend []byte) {
	m.rules = append(m.rules, xattrRule{typ: xrPrefix, client: true, server: true, key: key, prepend: prepend})
	if len(key) == 0 {
		// Hide every host name without the prefix.
		m.rules = append(m.rules, xattrRule{typ: xrBad, client: true, server: true})
		return
	}
	m.rules = append(m.rules,
		// Hide host names that match key without the prefix.
		xattrRule{typ: xrBad, server: true, prepend: key},
		// Keep the guest from reaching prefixed names directly.
		xattrRule{typ: xrBad, client: true, key: prepend},
		// Everything else passes.
		xattrRule{typ: xrOK, client: true, server: true},
	)
}

// toHost maps a guest name to the host name.
func (m *xattrMap) toHost(name []byte) ([]byte, syscall.Errno) {
	for i := range m.rules {
		r := &m.rules[i]
		if !r.client || !bytes.HasPrefix(name, r.key) {
			continue
		}
		switch r.typ {
		case xrBad:
			return nil, syscall.EPERM
		case xrUnsupported:
			return nil, syscall.ENOTSUP
		case xrOK:
			return name, 0
		default:
			out := make([]byte, 0, len(r.prepend)+len(name))
			return append(append(out, r.prepend...), name...), 0
		}
	}
	return nil, syscall.EPERM
}

// toGuest maps a host name for the guest; false hides it.
func (m *xattrMap) toGuest(name []byte) ([]byte, bool) {
	for i := range m.rules {
		r := &m.rules[i]
		if !r.server || !bytes.HasPrefix(name, r.prepend) {
			continue
		}
		switch r.typ {
		case xrOK:
			return name, true
		case xrPrefix:
			if len(name) == len(r.prepend) {
				return nil, false
			}
			return name[len(r.prepend):], true
		default:
			return nil, false
		}
	}
	return nil, false
}
