package main

import (
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
)

// usageFunc is --help's text after the command's summary: pflag's list of
// the long flags, then the flags it cannot list (shortOptionsUsage). The
// defaults are those of o as it is now, before the command line is parsed.
func usageFunc(o *Options) func(*cobra.Command) error {
	short := shortOptionsUsage(o)
	return func(c *cobra.Command) error {
		_, err := fmt.Fprintf(c.OutOrStderr(), "Usage:\n  %s\n\nFlags:\n%s\nOptions of the C virtiofsd without a long form:\n%s",
			c.UseLine(), c.LocalFlags().FlagUsages(), short)
		return err
	}
}

// shortOptionsUsage lists, as pflag lists the others, -o and the options
// that have no long flag: the C daemon's short flags and its -o options
// the Rust daemon has no long option for.
func shortOptionsUsage(o *Options) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
	fmt.Fprintf(w, "  -o OPTIONS\t%s\n", oUsage)
	for i := range optionTable {
		opt := &optionTable[i]
		if opt.long != "" {
			continue
		}
		var spellings []string
		if opt.short != "" {
			spellings = append(spellings, "-"+opt.short)
		}
		if s := opt.oSpelling(); s != "" {
			spellings = append(spellings, s)
		}
		line := strings.ReplaceAll(opt.usage, "`", "")
		def := opt.defaultValue(o)
		switch {
		case opt.kind == optBool && opt.oKey != "" && opt.get != nil:
			// As the C daemon's help says it: KEY or no_KEY.
			if def == "true" {
				def = opt.oKey
			} else {
				def = "no_" + opt.oKey
			}
		case def == "false":
			def = ""
		}
		if def != "" {
			line += " (default " + def + ")"
		}
		fmt.Fprintf(w, "  %s\t%s\n", strings.Join(spellings, ", "), line)
	}
	w.Flush()
	return b.String()
}
